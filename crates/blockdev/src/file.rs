//! PLACEHOLDER: the raw file device is being written.
#[derive(Debug, Clone, Default)]
pub struct FileOptions {
    pub read_only: bool,
    pub direct: bool,
}
#[derive(Debug)]
pub struct FileDev;
