//! Opening models on devices: a decoder on a device set (one device, a meta device with a
//! split, or the scheduler for a layer or hybrid split) and an encoder on a list of devices.
//! This is the one layer that knows both the models and the devices: `models/` builds graphs
//! and split callbacks only, `devices.rs` opens devices only. `lockstep.rs`: the ranks of a
//! job taking rank 0's batch steps (`serve --dist mpi`).

pub mod encoder;
pub mod identity;
pub mod layered;
pub mod lockstep;
pub mod open;

pub use encoder::open_encoder;
pub use identity::model_identity;
pub use layered::{Layered, Staging, open_layered};
pub use open::{OpenOptions, open_decoder};
