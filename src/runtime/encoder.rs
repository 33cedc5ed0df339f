//! Open a BERT encoder on a list of devices: one device runs the graph itself; several form a
//! meta device with the built-in split (`models::bert::bert_split`) or a per-layer assignment.

use crate::backend::Device;
use crate::meta::MetaDevice;
use crate::models::bert::{BertConfig, BertEncoder, bert_split};
use crate::models::split::{DecoderSplit, by_layer};
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

/// Load the model folder `dir` onto `devices`, several split by `split` (a per-layer
/// assignment, e.g. `planner::Strategy::split(n_layer)`, see `models::split::by_layer`) or
/// the built-in split when `None`. One device ignores `split` (there is nothing to split).
pub fn open_encoder(
    dir: impl AsRef<Path>,
    devices: Vec<Arc<dyn Device>>,
    split: Option<DecoderSplit>,
) -> Result<BertEncoder> {
    let dir = dir.as_ref();
    let cfg = BertConfig::from_model_dir(dir)?;
    let device: Arc<dyn Device> = match devices.len() {
        0 => {
            return Err(Error::invalid_input(
                "bert",
                "devices",
                "at least one",
                "none",
            ));
        }
        1 => devices.into_iter().next().expect("one device"),
        _ => {
            let f = match split {
                Some(s) => by_layer(&cfg, s),
                None => bert_split(&cfg),
            };
            MetaDevice::new(devices, f)?
        }
    };
    BertEncoder::load_on(dir, device)
}
