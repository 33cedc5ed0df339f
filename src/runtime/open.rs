//! Open a GGUF decoder on a device set in one call: resolve the model name, read the header,
//! open the devices (one device, or a meta device with the built-in Megatron split, a plan or
//! `--tensor-split` ratios, or the scheduler for a layer or hybrid split), and load the
//! weights with a progress callback. A tensor split with fewer KV-head groups than devices
//! repeats each KV head (`models::split::kv_repeat`, virtual KV heads); a tied output shares
//! the embedding's bytes where both lie alike (one device; both split by vocabulary, as the
//! built-in split and every strategy that splits the output have them for a tied model,
//! `DecoderSplit::tied`; both mirrored).

use super::layered::{Staging, open_layered};
use crate::cpu::Precision;
use crate::devices::DeviceSet;
use crate::meta::MetaOptions;
use crate::models::hparams::config_from_gguf;
use crate::models::layer_split::SplitMode;
use crate::models::loader::{DecoderModel, LoadOptions, file_tensors, output_tied};
use crate::models::paths::{ModelPath, resolve};
use crate::models::split::{
    DecoderSplit, ExpertSplit, SplitDims, SplitOptions, kv_repeat, megatron_plan, policy,
};
use crate::{Error, Result};

/// How to open a decoder.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    pub precision: Precision,
    /// Per-device shares of the split, e.g. `[3.0, 1.0]`; even when absent.
    pub ratios: Option<Vec<f64>>,
    /// Keep attention mirrored on every device instead of head-split.
    pub mirror_attention: bool,
    /// A per-layer assignment (a strategy or a plan) instead of the built-in split; its
    /// layer count must be the model's. Its sequence parallelism becomes the meta device's
    /// state hints.
    pub split: Option<DecoderSplit>,
    /// How the experts of a mixture of experts are split (overrides the plan's; the built-in
    /// split's default, tensor, when absent).
    pub experts: Option<ExpertSplit>,
    pub meta: MetaOptions,
    /// Tensor parallelism (the meta device), or layer / hybrid split on the scheduler.
    pub split_mode: SplitMode,
    /// Device groups of the hybrid split (each a meta device); 2 when absent.
    pub groups: Option<usize>,
    /// How the devices are spread over processes (`Dist::Mpi`: `devices` is this process's
    /// one device, and every process of the MPI job loads its own rank's slices).
    pub dist: crate::dist::Dist,
}

/// Open `devices` and load the GGUF decoder `model` (`smollm2` or a path) on them.
/// `progress(done, total)` is called with bytes of the file as weights are placed.
pub fn open_decoder(
    model: &str,
    devices: &str,
    opts: &OpenOptions,
    progress: &dyn Fn(usize, usize),
) -> Result<(DeviceSet, DecoderModel)> {
    let ModelPath::Gguf(path) = resolve(model)? else {
        return Err(Error::Model {
            model: model.to_string(),
            reason: "this command needs a GGUF decoder; use `embed` for encoder models".into(),
        });
    };
    let g = crate::models::legacy_experts::open_gguf(&path)?;
    let cfg = config_from_gguf(&g)?;
    // The split keeps whole blocks of every tensor's own type (a file mixes types).
    let dims = SplitDims::from(&cfg).with_blocks(&file_tensors(&g, &cfg)?);
    let tied = output_tied(&g, &cfg);
    drop(g);
    // `--expert-groups` against the devices that split the experts (in a hybrid split, the
    // smallest group's; under MPI each process sees one device, and the callback keeps at
    // most one group per device).
    if let Some(e) = opts.experts
        && opts.dist == crate::dist::Dist::Local
    {
        let n = crate::parse_devices(devices)?.len();
        let n = match opts.split_mode {
            SplitMode::Hybrid => n / opts.groups.unwrap_or(2).max(1),
            _ => n,
        };
        e.check_groups(n.max(1))?;
    }
    if opts.split_mode != SplitMode::Tensor {
        if opts.dist != crate::dist::Dist::Local {
            return Err(Error::invalid_argument(
                "--split-mode",
                opts.split_mode.name(),
                "a layer or hybrid split runs in one process; use --split-mode tensor with \
                 --dist mpi",
            ));
        }
        if opts.split_mode == SplitMode::Layer && opts.experts.is_some() {
            return Err(Error::invalid_argument(
                "--experts",
                opts.experts.unwrap_or_default().name(),
                "--split-mode layer gives each device whole layers, experts included; --experts \
                 splits them over the devices of a group (--split-mode hybrid) or of the tensor \
                 split",
            ));
        }
        if opts.split.is_some() || opts.mirror_attention {
            return Err(Error::invalid_argument(
                "--split-mode",
                opts.split_mode.name(),
                "--strategy, --plan and --mirror-attention choose a tensor split; use \
                 --split-mode tensor with them",
            ));
        }
        let (set, kv_repeat) = open_layered(
            devices,
            opts.precision,
            opts.meta,
            &dims,
            &Staging {
                mode: opts.split_mode,
                shares: opts.ratios.as_deref(),
                groups: opts.groups.unwrap_or(2),
                experts: opts.experts.unwrap_or_default(),
            },
        )?;
        // The scheduler places the embedding and the output by name on different backends:
        // a tied output is a copy of its own.
        let load = LoadOptions {
            kv_repeat,
            share_tied: false,
        };
        let m = DecoderModel::load_with(&path, set.buffer_type.as_ref(), &load, progress)?;
        return Ok((set, m));
    }
    let plan = match &opts.split {
        Some(plan) => {
            if plan.layers.len() != cfg.n_layer {
                return Err(Error::invalid_argument(
                    "split plan",
                    format!("{} layers", plan.layers.len()),
                    format!("the model has {} layers", cfg.n_layer),
                ));
            }
            let mut plan = plan.clone();
            if plan.ratios.is_none() {
                plan.ratios = opts.ratios.clone();
            }
            if let Some(e) = opts.experts {
                plan.experts = e;
            }
            plan
        }
        // A tied embedding split by vocabulary as the output is (one table).
        None => megatron_plan(
            cfg.n_layer,
            SplitOptions {
                ratios: opts.ratios.clone(),
                mirror_attention: opts.mirror_attention,
                experts: opts.experts.unwrap_or_default(),
            },
        )
        .tied(tied),
    };
    // One device (the callback is not called) shares a tied output's bytes with the
    // embedding; a meta device where both are split alike.
    let load = std::cell::Cell::new(LoadOptions {
        kv_repeat: 1,
        share_tied: true,
    });
    let set = DeviceSet::open_dist(devices, opts.dist, opts.precision, opts.meta, |n| {
        let r = kv_repeat(&dims, n, &plan);
        load.set(LoadOptions {
            kv_repeat: r,
            share_tied: plan.output == plan.embedding,
        });
        policy(dims.with_kv_repeat(r), plan)
    })?;
    let m = DecoderModel::load_with(&path, set.buffer_type.as_ref(), &load.get(), progress)?;
    Ok((set, m))
}
