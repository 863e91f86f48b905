//! Checkpoint epochs: the generation and slot of the newest durable
//! checkpoint, the epoch the journal writes in, and whether a checkpoint
//! is in flight.
//!
//! It owns the numbering rules only: a new checkpoint takes the epoch the
//! journal already writes in when the last one failed (its batches are
//! already tagged with it), else the next generation; it goes to the slot
//! the durable one does not occupy; a failure leaves the durable one as it
//! was. It never writes the journal or a checkpoint (see `checkpoint`).

use crate::journal::CheckpointMark;

#[derive(Debug)]
pub(crate) struct Epochs {
    /// Generation and slot of the newest durable checkpoint.
    generation: u64,
    durable_slot: usize,
    /// Generation of the newest checkpoint started: the epoch the journal
    /// writes in (one past `generation` while a checkpoint is in flight or
    /// after one failed; two past after recovery).
    epoch: u64,
    running: bool,
}

impl Epochs {
    /// After checkpoint `durable`, the journal writing in `epoch`.
    pub(crate) fn new(durable: CheckpointMark, epoch: u64) -> Epochs {
        Epochs {
            generation: durable.generation,
            durable_slot: durable.slot,
            epoch,
            running: false,
        }
    }

    /// A checkpoint is in flight.
    pub(crate) fn running(&self) -> bool {
        self.running
    }

    /// The epoch the journal writes in.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// No checkpoint failed or is owed since the durable one: a new one
    /// may be handed to the background.
    pub(crate) fn settled(&self) -> bool {
        self.epoch == self.generation
    }

    /// Numbers the next checkpoint: (generation, slot). The journal writes
    /// in its epoch from now on.
    pub(crate) fn begin(&mut self) -> (u64, usize) {
        let generation = if self.epoch > self.generation {
            self.epoch
        } else {
            self.generation + 1
        };
        self.epoch = generation;
        (generation, 1 - self.durable_slot)
    }

    /// A begun checkpoint was handed to the background.
    pub(crate) fn started(&mut self) {
        self.running = true;
    }

    /// The checkpoint in flight (if any) landed as `mark`, or failed.
    pub(crate) fn landed(&mut self, mark: Option<CheckpointMark>) {
        self.running = false;
        if let Some(mark) = mark {
            self.generation = mark.generation;
            self.durable_slot = mark.slot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(generation: u64, slot: usize) -> CheckpointMark {
        CheckpointMark {
            generation,
            slot,
            journal_seq: 0,
            journal_pos: 0,
        }
    }

    #[test]
    fn checkpoints_alternate_slots_and_count_up() {
        let mut e = Epochs::new(mark(4, 0), 4);
        assert!(e.settled());
        assert_eq!(e.begin(), (5, 1));
        e.started();
        assert!(e.running() && !e.settled());
        assert_eq!(e.epoch(), 5);
        e.landed(Some(mark(5, 1)));
        assert!(!e.running() && e.settled());
        assert_eq!(e.begin(), (6, 0));
    }

    #[test]
    fn a_failed_checkpoint_is_retried_in_its_epoch_and_slot() {
        let mut e = Epochs::new(mark(4, 0), 4);
        assert_eq!(e.begin(), (5, 1));
        e.landed(None);
        assert!(!e.settled(), "owed: the journal writes in epoch 5");
        assert_eq!(e.begin(), (5, 1));
    }

    #[test]
    fn after_recovery_the_next_checkpoint_takes_the_journals_epoch() {
        let mut e = Epochs::new(mark(4, 1), 6);
        assert!(!e.settled());
        assert_eq!(e.begin(), (6, 0));
        e.landed(Some(mark(6, 0)));
        assert!(e.settled());
    }
}
