//! How vdstream opens and creates the files it keeps: store layers and metadata, write
//! caches, journals, overflow files, attach records and token files.
//!
//! Those folders are data, not instructions. Two rules hold for every file opened here:
//!
//! - **No symbolic link is followed.** Files are opened with `O_NOFOLLOW`: a layer, cache
//!   or record replaced by a link (to `/etc/shadow`, to another target's cache) is refused
//!   with an error that names it, never read through or written through. A path that an
//!   administrator types (an image to serve, a block device under `/dev/disk/by-id`) is
//!   resolved once by the command that takes it ([`resolve_named`]), and opened so.
//! - **Modes are owner-only, whatever the umask.** The umask can only take bits away from
//!   the mode given at creation, so files are created [`PRIVATE`] (a target's writes,
//!   secrets) or [`SHARED_READ`] (layers and metadata, which the group of the store's
//!   owner may read), and folders [`FOLDER`]. A file found with looser bits than it
//!   should have (made by an older build, or by hand) is tightened through its own
//!   descriptor ([`tighten`]), which cannot be redirected by a link.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// A file only its owner reads: write caches, journals, overflow files, attach records,
/// token files.
pub const PRIVATE: u32 = 0o600;
/// A file the owner writes and the owner's group may read: layers and metadata.
pub const SHARED_READ: u32 = 0o640;
/// A folder of the store or of a cache: no write for the group, nothing for others.
pub const FOLDER: u32 = 0o750;

/// Open options that never follow a symbolic link in the last component, close on exec,
/// and create (when asked to) with `mode`.
pub fn options(mode: u32) -> OpenOptions {
    let mut o = OpenOptions::new();
    o.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(mode);
    o
}

/// Opens `path` read-only without following a link.
pub fn open_read(path: &Path) -> io::Result<File> {
    options(PRIVATE)
        .read(true)
        .open(path)
        .map_err(|e| explain(e, path))
}

/// Opens `path` read-write without following a link, creating it with `mode` when it is
/// missing and keeping its bytes when it is there (a lock file, a record read then
/// rewritten).
pub fn open_rw(path: &Path, mode: u32) -> io::Result<File> {
    options(mode)
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| explain(e, path))
}

/// Opens an existing `path` read-write without following a link.
pub fn open_existing_rw(path: &Path) -> io::Result<File> {
    options(PRIVATE)
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| explain(e, path))
}

/// Makes a new file at `path` with `mode` for writing; an error if anything is there.
pub fn create_new(path: &Path, mode: u32) -> io::Result<File> {
    options(mode)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| explain(e, path))
}

/// [`create_new`] after removing whatever sits at `path` (a temporary file a crash left,
/// or a link planted in its place: unlink does not follow it), so that a temporary file is
/// always made, never opened through an existing name.
pub fn create_fresh(path: &Path, mode: u32) -> io::Result<File> {
    let _ = std::fs::remove_file(path);
    create_new(path, mode)
}

/// Turns the error of an open that met a symbolic link (`ELOOP` under `O_NOFOLLOW`) into
/// one that says so and what to do; any other error is returned as it is.
pub fn explain(e: io::Error, path: &Path) -> io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) && is_symlink(path) {
        return io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is a symbolic link, and vdstream follows no link in its store or cache folders: replace it with the file itself (or remove it)",
                path.display()
            ),
        );
    }
    e
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// Creates `dir` and its missing parents with [`FOLDER`] mode, and refuses it when it is a
/// symbolic link (a folder of the store replaced by a link would lead every file below it
/// elsewhere).
pub fn create_dir_all(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(FOLDER)
        .create(dir)?;
    refuse_symlinked_dir(dir)
}

/// An error when `dir` is a symbolic link (naming it), `Ok` when it is a real folder or
/// does not exist.
pub fn refuse_symlinked_dir(dir: &Path) -> io::Result<()> {
    if is_symlink(dir) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is a symbolic link, and vdstream follows no link in its store or cache folders: make it a real folder",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// Takes away the permission bits `file` has beyond `mode` (through its descriptor); the
/// bits it had when it needed tightening, `None` when it did not.
pub fn tighten(file: &File, mode: u32) -> io::Result<Option<u32>> {
    let have = file.metadata()?.permissions().mode() & 0o777;
    if have & !mode == 0 {
        return Ok(None);
    }
    file.set_permissions(std::fs::Permissions::from_mode(have & mode))?;
    Ok(Some(have))
}

/// [`tighten`], logged: a file the process keeps (a cache, a record) found readable by
/// others is made owner-only again, and the log says so once per open.
pub fn tighten_logged(file: &File, mode: u32, path: &Path) {
    match tighten(file, mode) {
        Ok(Some(was)) => log::warn!(
            "{} had mode {was:o}; made it {:o} (vdstream keeps it owner-only)",
            path.display(),
            was & mode
        ),
        Ok(None) => {}
        Err(e) => log::warn!(
            "cannot make {} owner-only ({e}): fix its mode by hand (chmod {mode:o})",
            path.display()
        ),
    }
}

/// A path an administrator named on the command line (an image to serve, a block device
/// under `/dev/disk/by-id`): resolved once to the file it names, links included, so that
/// the opens that follow (which follow no link) reach it.
pub fn resolve_named(path: &Path) -> io::Result<PathBuf> {
    std::fs::canonicalize(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn links_are_refused_by_name_and_the_target_is_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"secret").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        let link = dir.path().join("t.vdattach");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = options(PRIVATE)
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&link)
            .map_err(|e| explain(e, &link))
            .unwrap_err();
        assert!(
            e.to_string().contains("t.vdattach is a symbolic link"),
            "{e}"
        );
        let e = open_read(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"secret");
        assert_eq!(
            std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777,
            0o644,
            "the link's target keeps its mode"
        );
    }

    #[test]
    fn files_and_folders_are_owner_only_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: umask only sets the process's file mode mask; the test restores it.
        let old = unsafe { libc::umask(0) };
        let f = dir.path().join("cache");
        let mut file = options(PRIVATE)
            .write(true)
            .create_new(true)
            .open(&f)
            .unwrap();
        file.write_all(b"x").unwrap();
        let d = dir.path().join("a/b");
        create_dir_all(&d).unwrap();
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
            0o750
        );
        assert_eq!(
            std::fs::metadata(dir.path().join("a"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o750
        );
    }

    #[test]
    fn loose_files_are_tightened_and_symlinked_folders_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("journal");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let file = open_read(&f).unwrap();
        assert_eq!(tighten(&file, PRIVATE).unwrap(), Some(0o644));
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(tighten(&file, PRIVATE).unwrap(), None);
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("vdisks");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = create_dir_all(&link).unwrap_err();
        assert!(e.to_string().contains("vdisks is a symbolic link"), "{e}");
    }
}
