//! What the running code is doing, for the tools that show it: the context of each allocation (step, phase,
//! layer, op; [`context`]) that memory snapshots record, and step traces in Chrome's format ([`trace`]). Low in
//! the module stack, so the ops and the model can mark where they are.

pub mod context;
pub mod trace;
