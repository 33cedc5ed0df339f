//! The scheduler's buffer type: a placement of named tensors on the scheduler's backends. A
//! `SchedBuffer` holds no memory of its own; each tensor placed in it (`init_tensor`, which
//! model loaders and cache allocators call with the tensor's name) is allocated in the buffer
//! type of the backend a placement callback names, and reads and writes go to that allocation.
//!
//! This is how a model's layers land on different devices with no change to the loader: the
//! layer split's callback maps `blk.N.*` and `cache_*_lN` to the backend of layer N. The
//! scheduler resolves a leaf bound in a `SchedBuffer` to the real allocation and pins the nodes
//! that read it to its backend (pass (a)); logical CPU devices all use host memory, so without
//! this ownership nothing would tell their weights apart.

use crate::buffer::{Buffer, BufferType, BufferUsage, Storage};
use crate::tensor::Layout;
use crate::{Error, Result};
use parking_lot::{Mutex, RwLock};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Which backend (an index in the scheduler's priority order) a named tensor is placed on.
pub type PlaceFn = Arc<dyn Fn(&str) -> usize + Send + Sync>;

/// What the buffer type and its buffers share: the scheduler they belong to, its backends'
/// buffer types and names, and the placement callback.
pub(crate) struct Placement {
    pub(crate) sched_id: u64,
    pub(crate) bts: Vec<Arc<dyn BufferType>>,
    pub(crate) names: Vec<String>,
    pub(crate) place: PlaceFn,
}

/// Buffers whose tensors each live on the backend the placement callback names.
pub struct SchedBufferType {
    pub(crate) placement: Arc<Placement>,
}

impl BufferType for SchedBufferType {
    fn name(&self) -> String {
        format!("sched[{}]", self.placement.names.join(","))
    }

    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>> {
        Ok(Arc::new(SchedBuffer {
            placement: self.placement.clone(),
            size,
            tensors: RwLock::new(BTreeMap::new()),
            usage: Mutex::new(BufferUsage::Any),
        }))
    }

    fn alignment(&self) -> usize {
        self.placement
            .bts
            .iter()
            .map(|b| b.alignment())
            .max()
            .unwrap_or(64)
            .max(1)
    }

    fn alloc_size(&self, layout: &Layout) -> usize {
        self.placement
            .bts
            .iter()
            .map(|b| b.alloc_size(layout))
            .max()
            .unwrap_or_else(|| layout.nbytes())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One tensor of a `SchedBuffer`: its backend and its real storage there.
#[derive(Clone)]
pub struct Placed {
    pub name: String,
    pub layout: Layout,
    pub backend: usize,
    pub storage: Storage,
}

/// A buffer of [`SchedBufferType`]: tensors by offset, each in its backend's memory.
pub struct SchedBuffer {
    placement: Arc<Placement>,
    size: usize,
    tensors: RwLock<BTreeMap<usize, Placed>>,
    usage: Mutex<BufferUsage>,
}

impl SchedBuffer {
    pub(crate) fn sched_id(&self) -> u64 {
        self.placement.sched_id
    }

    /// The tensor whose span holds byte `offset`, and `offset`'s position inside it.
    pub fn resolve(&self, offset: usize) -> Option<(Placed, usize)> {
        let t = self.tensors.read();
        let (&start, p) = t.range(..=offset).next_back()?;
        let inside = offset - start;
        (inside < p.layout.nbytes().max(1)).then(|| (p.clone(), inside))
    }

    /// Every placed tensor, by offset.
    pub fn placed(&self) -> Vec<Placed> {
        self.tensors.read().values().cloned().collect()
    }

    fn at(&self, what: &str, buf_offset: usize) -> Result<(Storage, usize)> {
        let (p, inside) = self.resolve(buf_offset).ok_or_else(|| Error::OutOfBounds {
            what: format!("{what}: no tensor placed in a scheduler buffer at this offset"),
            offset: buf_offset,
            size: 0,
            capacity: self.size,
        })?;
        Ok((p.storage, inside))
    }
}

impl Buffer for SchedBuffer {
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(SchedBufferType {
            placement: self.placement.clone(),
        })
    }

    fn size(&self) -> usize {
        self.size
    }

    fn init_tensor(&self, name: &str, layout: &Layout, offset: usize) -> Result<()> {
        let mut t = self.tensors.write();
        if let Some(p) = t.get(&offset) {
            if p.layout.nbytes() == layout.nbytes() {
                return Ok(());
            }
            return Err(Error::BufferTooSmall {
                what: format!(
                    "`{name}` over `{}` in a scheduler buffer at offset {offset}",
                    p.name
                ),
                needed: layout.nbytes(),
                available: p.layout.nbytes(),
            });
        }
        let pl = &self.placement;
        let backend = (pl.place)(name);
        let bt = pl.bts.get(backend).ok_or_else(|| {
            Error::invalid_argument(
                "tensor placement",
                format!("`{name}` on backend {backend}"),
                format!("the scheduler has {} backends", pl.bts.len()),
            )
        })?;
        let buf = bt.alloc_buffer(bt.alloc_size(layout).max(1))?;
        buf.set_usage(*self.usage.lock());
        buf.init_tensor(name, layout, 0)?;
        t.insert(
            offset,
            Placed {
                name: name.to_string(),
                layout: *layout,
                backend,
                storage: Storage::new(buf, 0),
            },
        );
        Ok(())
    }

    fn set_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        data: &[u8],
        offset: usize,
    ) -> Result<()> {
        let (st, inside) = self.at("set_tensor", buf_offset)?;
        st.buffer
            .set_tensor(layout, st.offset + inside, data, offset)
    }

    fn get_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        out: &mut [u8],
        offset: usize,
    ) -> Result<()> {
        let (st, inside) = self.at("get_tensor", buf_offset)?;
        st.buffer
            .get_tensor(layout, st.offset + inside, out, offset)
    }

    fn memset_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        value: u8,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        let (st, inside) = self.at("memset_tensor", buf_offset)?;
        st.buffer
            .memset_tensor(layout, st.offset + inside, value, offset, size)
    }

    fn clear(&self, value: u8) {
        for p in self.tensors.read().values() {
            p.storage.buffer.clear(value);
        }
    }

    fn usage(&self) -> BufferUsage {
        *self.usage.lock()
    }

    fn set_usage(&self, usage: BufferUsage) {
        *self.usage.lock() = usage;
        for p in self.tensors.read().values() {
            p.storage.buffer.set_usage(usage);
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
