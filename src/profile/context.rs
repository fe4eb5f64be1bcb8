//! What running code is doing — the optimizer step, its phase, the layer and the op — for the frames of a memory
//! snapshot's allocations. Global, not per thread (Candle's CPU ops allocate on worker threads), set by the one
//! thread that drives training: the trainer sets the step and phase, the model the layer, each op its name, each
//! as a scope that restores what it replaced.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// The phase of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Outside a training step (loading, evaluation, saving).
    Idle = 0,
    /// A micro-batch's forward.
    Forward = 1,
    /// A checkpointed layer recomputed in the backward.
    Recompute = 2,
    /// The backward.
    Backward = 3,
    /// Clipping and the optimizer update.
    Optimizer = 4,
}

impl Phase {
    /// The phase's name (`forward`, …).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Forward => "forward",
            Phase::Recompute => "recompute",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            1 => Phase::Forward,
            2 => Phase::Recompute,
            3 => Phase::Backward,
            4 => Phase::Optimizer,
            _ => Phase::Idle,
        }
    }
}

static STEP: AtomicU32 = AtomicU32::new(0);
static PHASE: AtomicU8 = AtomicU8::new(0);
/// The layer index, −1 outside the layers.
static LAYER: AtomicI32 = AtomicI32::new(-1);
/// The op's name as a packed `&'static str` (see [`pack`]), 0 for none.
static OP: AtomicU64 = AtomicU64::new(0);

/// A `&'static str` as one word: its address (48 bits on the platforms Rust targets) and its length (16 bits);
/// 0 when it does not fit.
fn pack(name: &'static str) -> u64 {
    let (ptr, len) = (name.as_ptr() as u64, name.len() as u64);
    if ptr >> 48 == 0 && len < 1 << 16 {
        ptr << 16 | len
    } else {
        0
    }
}

/// The name [`pack`] packed.
fn unpack(word: u64) -> Option<&'static str> {
    if word == 0 {
        return None;
    }
    let (ptr, len) = ((word >> 16) as *const u8, (word & 0xffff) as usize);
    // SAFETY: only `pack` makes the words `OP` holds, from a `&'static str`: the bytes live forever and are UTF-8.
    Some(unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(ptr, len)) })
}

/// The context now: a few words, read without allocating (the allocator hook reads it). The default is outside
/// any step, layer and op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Context {
    step: u32,
    phase: u8,
    layer: i32,
    op: u64,
}

impl Default for Context {
    fn default() -> Self {
        Context {
            step: 0,
            phase: Phase::Idle as u8,
            layer: -1,
            op: 0,
        }
    }
}

impl Context {
    /// What the code is doing now.
    #[inline]
    pub fn now() -> Self {
        Context {
            step: STEP.load(Ordering::Relaxed),
            phase: PHASE.load(Ordering::Relaxed),
            layer: LAYER.load(Ordering::Relaxed),
            op: OP.load(Ordering::Relaxed),
        }
    }

    /// The optimizer step (1-based; 0 before the first).
    pub fn step(&self) -> u32 {
        self.step
    }

    /// The phase.
    pub fn phase(&self) -> Phase {
        Phase::from_code(self.phase)
    }

    /// The layer index, if inside one.
    pub fn layer(&self) -> Option<usize> {
        usize::try_from(self.layer).ok()
    }

    /// The op's name, if inside one of ours.
    pub fn op(&self) -> Option<&'static str> {
        unpack(self.op)
    }
}

/// Sets the optimizer step (1-based).
pub fn set_step(step: usize) {
    STEP.store(step as u32, Ordering::Relaxed);
}

/// Sets the phase until the next call.
pub fn set_phase(phase: Phase) {
    PHASE.store(phase as u8, Ordering::Relaxed);
}

/// Restores what a scope replaced when dropped.
#[must_use]
pub struct Scope {
    restore: fn(u64),
    previous: u64,
}

impl Drop for Scope {
    fn drop(&mut self) {
        (self.restore)(self.previous);
    }
}

/// The code runs op `name` until the scope ends.
pub fn op(name: &'static str) -> Scope {
    let previous = OP.swap(pack(name), Ordering::Relaxed);
    Scope {
        restore: |p| OP.store(p, Ordering::Relaxed),
        previous,
    }
}

/// The code runs in layer `index` until the scope ends.
pub fn layer(index: usize) -> Scope {
    let previous = LAYER.swap(index as i32, Ordering::Relaxed);
    Scope {
        restore: |p| LAYER.store(p as i32, Ordering::Relaxed),
        previous: previous as u32 as u64,
    }
}

/// The phase is `phase` until the scope ends.
pub fn phase(phase: Phase) -> Scope {
    let previous = PHASE.swap(phase as u8, Ordering::Relaxed);
    Scope {
        restore: |p| PHASE.store(p as u8, Ordering::Relaxed),
        previous: previous as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names round-trip through their packed word; the fields decode; a scope restores what it replaced. (The
    /// global context itself is shared with every test running ops, so it is not asserted here.)
    #[test]
    fn context_decodes_and_scopes_restore() {
        assert_eq!(unpack(pack("low-rank-linear")), Some("low-rank-linear"));
        assert_eq!(unpack(0), None);
        let c = Context {
            step: 3,
            phase: Phase::Recompute as u8,
            layer: 2,
            op: pack("attention"),
        };
        assert_eq!(
            (c.step(), c.phase(), c.layer(), c.op()),
            (3, Phase::Recompute, Some(2), Some("attention"))
        );
        let d = Context::default();
        assert_eq!((d.phase(), d.layer(), d.op()), (Phase::Idle, None, None));
        static SLOT: AtomicU64 = AtomicU64::new(7);
        {
            let previous = SLOT.swap(9, Ordering::Relaxed);
            let _scope = Scope {
                restore: |p| SLOT.store(p, Ordering::Relaxed),
                previous,
            };
            assert_eq!(SLOT.load(Ordering::Relaxed), 9);
        }
        assert_eq!(SLOT.load(Ordering::Relaxed), 7);
    }
}
