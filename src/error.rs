//! The crate-wide error type: one enum with structured variants grouped by area, and the
//! [`Result`] alias. Variants carry what a user needs to act: the op, the tensor name, the
//! shapes, the split states, the file and the field.

use std::path::PathBuf;

/// Shapes in errors are printed in ggml order, `[ne0, ne1, ne2, ne3]`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Shape(pub [usize; 4]);

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ne = self.0;
        write!(f, "[{}, {}, {}, {}]", ne[0], ne[1], ne[2], ne[3])
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- graph building -------------------------------------------------------------
    /// Two operands of an op have shapes the op cannot combine.
    #[error("{op}: shapes do not match: {lhs} and {rhs} ({reason})")]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
        reason: String,
    },
    /// An operand has a dtype the op does not take.
    #[error("{op}: operand `{operand}` has dtype {got}, expected {expected}")]
    DTypeMismatch {
        op: &'static str,
        operand: String,
        expected: String,
        got: String,
    },
    /// An op's parameters are invalid (axis out of range, bad permutation, ...).
    #[error("{op}: {reason}")]
    InvalidOp { op: &'static str, reason: String },
    /// A tensor id does not belong to the graph.
    #[error("tensor id {id} is not in this graph (graph has {len} tensors)")]
    UnknownTensor { id: usize, len: usize },
    /// A row of a quantized type that is not a whole number of blocks.
    #[error("{what}: row length {ne0} is not a multiple of the {dtype} block size {block}")]
    PartialBlock {
        what: String,
        ne0: usize,
        /// The element type's name (`q4_0`).
        dtype: &'static str,
        block: usize,
    },
    /// A tensor whose bytes do not fit the address space.
    #[error("tensor `{tensor}` {shape} of {dtype} needs more bytes than memory can address")]
    TensorTooLarge {
        tensor: String,
        shape: Shape,
        /// The element type's name (`q4_0`).
        dtype: &'static str,
    },
    /// Storage bound to a view: only roots own bytes.
    #[error("cannot bind storage to `{tensor}`: it is a view; bind its root `{root}`")]
    BindToView { tensor: String, root: String },
    /// Storage at an offset the tensor's kernels cannot read from.
    #[error("cannot bind `{tensor}` at offset {offset}: {dtype} data must be {align}-byte aligned")]
    MisalignedBinding {
        tensor: String,
        offset: usize,
        /// The element type's name (`q4_0`).
        dtype: &'static str,
        align: usize,
    },
    /// Something only a leaf can have (inline data) given to a computed node.
    #[error("{action}: `{tensor}` is not a leaf but a {op} node")]
    NotALeaf {
        action: &'static str,
        tensor: String,
        op: &'static str,
    },

    // ---- backends ---------------------------------------------------------------------
    /// The backend has no kernel for this op with these operand types and layouts.
    #[error("{backend}: op {op} on node `{node}` is not supported ({detail})")]
    UnsupportedOp {
        backend: String,
        op: String,
        node: String,
        detail: String,
    },
    /// A tensor has no storage where the backend needs it (a leaf with neither a buffer nor data).
    #[error("tensor `{tensor}` has no storage: {reason}")]
    NoStorage { tensor: String, reason: String },
    /// A tensor lives in a buffer this backend cannot read.
    #[error(
        "{backend}: tensor `{tensor}` lives in buffer type {buffer_type}, which this backend cannot use"
    )]
    IncompatibleBuffer {
        backend: String,
        tensor: String,
        buffer_type: String,
    },
    /// A kernel read an I32 row id outside the rows it indexes (a token id past the table, a
    /// KV slot past the cache). `index` is where the id sits in the ids tensor.
    #[error("{device}: node `{node}` ({op}): row id {id} is outside 0..{rows} (at ids{index:?})")]
    RowIdOutOfRange {
        device: String,
        node: String,
        op: &'static str,
        id: i64,
        index: [usize; 3],
        rows: usize,
    },
    /// A device string or device failure.
    #[error("device {device}: {reason}")]
    Device { device: String, reason: String },
    /// A device spent longer than the timeout inside one stage of its program (a kernel or a
    /// collective that never returned); its work was abandoned and the next compute starts
    /// afresh.
    #[error(
        "device {device} stalled: no progress for {waited:.1?} in {stage} (timeout {timeout:?}); \
         its work was abandoned and the next compute starts afresh"
    )]
    DeviceStalled {
        device: String,
        stage: String,
        waited: std::time::Duration,
        timeout: std::time::Duration,
    },
    // ---- scheduler ----------------------------------------------------------------------
    /// No backend of a scheduler computes this node (each backend's reason is listed).
    #[error("scheduler: no backend runs node `{node}` ({op}): {reasons}")]
    NoBackendFor {
        node: String,
        op: &'static str,
        reasons: String,
    },
    /// The scheduler cannot place a node on the backend the passes chose (it writes into a
    /// buffer that backend cannot use, or reads across backends a tensor written in place).
    #[error("scheduler: node `{node}` on {backend}: {reason}")]
    SchedPlacement {
        node: String,
        backend: String,
        reason: String,
    },
    /// The eval callback returned false after this node: the compute stopped there (the nodes
    /// after it did not run); the next compute starts afresh.
    #[error(
        "the eval callback stopped the compute after node `{node}` on {backend}; later nodes          did not run"
    )]
    EvalStopped { node: String, backend: String },
    /// The crate was built without the `cuda` feature.
    #[error("CUDA support is not compiled in: rebuild with `--features cuda`")]
    CudaNotCompiled,
    /// `--dist mpi` (ranks as processes) in a build without the `mpi` feature.
    #[error(
        "MPI support is not compiled in: rebuild with `--features mpi` (needs OpenMPI and \
         libclang: `apt-get install libopenmpi-dev openmpi-bin libclang-dev`)"
    )]
    MpiNotCompiled,

    // ---- memory -----------------------------------------------------------------------
    /// A read or write falls outside a tensor or a buffer.
    #[error("{what}: {size} bytes at offset {offset} do not fit in {capacity} bytes")]
    OutOfBounds {
        what: String,
        offset: usize,
        size: usize,
        capacity: usize,
    },
    /// A buffer is smaller than what must be placed in it.
    #[error("{what}: buffer of {available} bytes is too small, {needed} bytes needed")]
    BufferTooSmall {
        what: String,
        needed: usize,
        available: usize,
    },
    /// Bytes that cannot be seen as a slice of `elem` (length or alignment).
    #[error(
        "cannot view {len} bytes at {addr:#x} as {elem}: a multiple of {size} bytes, {align}-byte aligned, is needed"
    )]
    ByteView {
        len: usize,
        addr: usize,
        elem: &'static str,
        size: usize,
        align: usize,
    },
    /// A row's bytes do not match its element count.
    #[error("{what}: {elements} {dtype} elements take {expected} bytes, got {got}")]
    RowBytes {
        what: &'static str,
        /// The element type's name (`q4_0`).
        dtype: &'static str,
        elements: usize,
        expected: usize,
        got: usize,
    },
    /// An allocation failed or exceeds the buffer type's maximum.
    #[error("{buffer_type}: cannot allocate {size} bytes: {reason}")]
    AllocFailed {
        buffer_type: String,
        size: usize,
        reason: String,
    },

    // ---- split states and the meta backend --------------------------------------------
    /// A split state is invalid for its tensor.
    #[error("split state of tensor `{tensor}`: {reason}")]
    InvalidSplit { tensor: String, reason: String },
    /// No rule accepts this combination of source states.
    #[error("op {op} on node `{node}`: no rule for source states {states}: {reason}")]
    NoSplitRule {
        op: String,
        node: String,
        states: String,
        reason: String,
    },
    /// `explicit` mode: a conversion the plan did not ask for would be needed.
    #[error(
        "explicit mode: node `{node}` ({op}) needs source `{source_name}` as {to} but it is {from}; \
         this would insert {conversion}"
    )]
    UnrequestedCommunication {
        node: String,
        op: String,
        source_name: String,
        from: String,
        to: String,
        conversion: String,
    },

    /// A tensor is placed, bound or registered where the meta device cannot use it.
    #[error("meta device: tensor `{tensor}`: {reason}")]
    MetaPlacement { tensor: String, reason: String },
    /// An internal invariant failed: a bug, reported as an error instead of a panic.
    #[error("internal error in {component}: {reason} (a bug; please report it)")]
    Internal {
        component: &'static str,
        reason: String,
    },

    /// A plan does not fit: `device` is over its budget by `over` bytes `how` (with
    /// everything split that can be, when the search finds nothing; with the strategy a user
    /// fixed).
    #[error(
        "{model} does not fit on {cluster} {how}: device {device} needs {} more than its \
         budget of {}",
        human_bytes(*.over),
        human_bytes(*.budget)
    )]
    DoesNotFit {
        model: String,
        cluster: String,
        how: String,
        device: String,
        over: u64,
        budget: u64,
    },

    // ---- collectives ------------------------------------------------------------------
    /// A collective failed on this rank, or another rank failed and this one was released.
    #[error("collective {collective} on rank {rank} of {world}: {reason}")]
    Collective {
        collective: &'static str,
        rank: usize,
        world: usize,
        reason: String,
    },
    /// Another rank of a group of processes failed, exited or stalled: `rank` is the one at
    /// fault (not the reporting one); the group cannot recover (restart the job).
    #[error("rank {rank} of {world} failed ({collective}): {reason}")]
    RankFailed {
        rank: usize,
        world: usize,
        collective: &'static str,
        reason: String,
    },

    // ---- files and models -------------------------------------------------------------
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file's contents are malformed; `field` names what was being read.
    #[error("{path}: malformed {field}: {reason}")]
    Format {
        path: PathBuf,
        field: String,
        reason: String,
    },
    /// A model is missing something it needs or has something it cannot use.
    #[error("model {model}: {reason}")]
    Model { model: String, reason: String },

    // ---- parameters -------------------------------------------------------------------
    /// A parameter (a sampling setting, a count, a thread total, a command-line flag) has a
    /// value it cannot take; `name` is the parameter or flag, `value` what was given.
    #[error("{name} {value}: {reason}")]
    InvalidArgument {
        name: String,
        value: String,
        reason: String,
    },

    // ---- inputs and outside programs --------------------------------------------------
    /// An argument of a call (tokens, positions, a batch, a device list) is not what the call
    /// takes.
    #[error("{context}: {what}: expected {expected}, got {got}")]
    InvalidInput {
        context: &'static str,
        what: String,
        expected: String,
        got: String,
    },
    /// An outside program (a reference script) failed.
    #[error("{} failed ({status}): {stderr}", program.display())]
    ProgramFailed {
        program: PathBuf,
        status: String,
        stderr: String,
    },
    /// A value could not be written as JSON.
    #[error("{what}: cannot write JSON: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },

    /// Anything else, with a sentence that says what.
    #[error("{0}")]
    Msg(String),
}

impl Error {
    pub fn msg(s: impl Into<String>) -> Self {
        Error::Msg(s.into())
    }

    pub fn invalid_op(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidOp {
            op,
            reason: reason.into(),
        }
    }

    pub fn shape(
        op: &'static str,
        lhs: [usize; 4],
        rhs: [usize; 4],
        reason: impl Into<String>,
    ) -> Self {
        Error::ShapeMismatch {
            op,
            lhs: Shape(lhs),
            rhs: Shape(rhs),
            reason: reason.into(),
        }
    }

    pub fn format(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Error::Format {
            path: path.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn invalid_argument(
        name: impl Into<String>,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn invalid_input(
        context: &'static str,
        what: impl Into<String>,
        expected: impl std::fmt::Display,
        got: impl std::fmt::Display,
    ) -> Self {
        Error::InvalidInput {
            context,
            what: what.into(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `bail!("...")` returns `Err(Error::Msg(format!(...)))`.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::Error::Msg(format!($($arg)*)))
    };
}

/// `bytes` for people: GiB or MiB with two decimals (and the exact count), or bytes below
/// 1 MiB.
pub fn human_bytes(bytes: u64) -> String {
    const MIB: f64 = 1048576.0;
    let b = bytes as f64;
    if b >= 1024.0 * MIB {
        format!("{:.2} GiB ({bytes} B)", b / (1024.0 * MIB))
    } else if b >= MIB {
        format!("{:.2} MiB ({bytes} B)", b / MIB)
    } else {
        format!("{bytes} B")
    }
}
