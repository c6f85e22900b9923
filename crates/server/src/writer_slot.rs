//! One writer at a time: an export that takes one writer gives its connection a slot,
//! held as long as the connection holds its device; the next writer is refused, naming
//! the holder, until the slot is free. The maintenance versions of the store server and
//! `serve-image`'s read-write layer use it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vdstream_blockdev::{lock, BlockDev};

/// How long a new writer waits for one that just disconnected to let go.
pub const WRITER_HANDOVER: Duration = Duration::from_secs(1);

/// The writer slots of a set of exports: export (or vDisk) name → who writes it now.
#[derive(Debug, Clone, Default)]
pub struct WriterSlots(Arc<Mutex<HashMap<String, String>>>);

impl WriterSlots {
    /// Takes the slot of `name`, recording `holder()` as who holds it, after waiting up to
    /// [`WRITER_HANDOVER`] for a writer that just disconnected. `Err`: who holds it.
    pub fn take(&self, name: &str, holder: impl Fn() -> String) -> Result<WriterSlot, String> {
        let deadline = Instant::now() + WRITER_HANDOVER;
        loop {
            {
                let mut writers = lock(&self.0);
                match writers.get(name) {
                    None => {
                        writers.insert(name.to_string(), holder());
                        return Ok(WriterSlot {
                            slots: self.clone(),
                            name: name.to_string(),
                        });
                    }
                    Some(holder) if Instant::now() >= deadline => return Err(holder.clone()),
                    Some(_) => {}
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A taken writer slot; dropping it frees the slot.
#[derive(Debug)]
pub struct WriterSlot {
    slots: WriterSlots,
    name: String,
}

impl Drop for WriterSlot {
    fn drop(&mut self) {
        lock(&self.slots.0).remove(&self.name);
    }
}

/// A writer's device: `inner` with its slot, freed when the connection drops the device.
#[derive(Debug)]
pub struct SlotDev {
    inner: Arc<dyn BlockDev>,
    _slot: WriterSlot,
}

impl SlotDev {
    pub fn new(inner: Arc<dyn BlockDev>, slot: WriterSlot) -> Self {
        SlotDev { inner, _slot: slot }
    }
}

impl vdstream_blockdev::Filter for SlotDev {
    type Inner = dyn BlockDev;

    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_has_one_holder_until_it_is_dropped() {
        let slots = WriterSlots::default();
        let first = slots.take("m", || "the first".into()).unwrap();
        let started = Instant::now();
        assert_eq!(
            slots.take("m", || "the second".into()).unwrap_err(),
            "the first"
        );
        assert!(
            started.elapsed() >= WRITER_HANDOVER,
            "waited for a handover"
        );
        let other = slots.take("n", || "another export".into());
        assert!(other.is_ok(), "slots are per name");
        drop(first);
        assert!(slots.take("m", || "the second".into()).is_ok());
    }
}
