//! Devices that hold no memory and compute nothing, for planning: a meta device over them
//! places a model's weights and KV cache (each device "allocates" its slices, so per-device
//! bytes are exact) and its graphs go through the same sharding and rewrite passes as a real
//! run, without a byte of weights. Planning Llama-3-70B on 8 devices therefore needs no memory
//! beyond the graph.

use crate::backend::{Backend, Device, DeviceKind, MemoryInfo};
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::graph::{Graph, TensorId};
use crate::tensor::Layout;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::any::Any;
use std::sync::Arc;

/// A device of a planned cluster: a name and a memory budget, nothing else.
#[derive(Debug)]
pub struct VirtualDevice {
    pub name: String,
    pub memory: u64,
}

impl VirtualDevice {
    pub fn shared(name: impl Into<String>, memory: u64) -> Arc<dyn Device> {
        Arc::new(VirtualDevice {
            name: name.into(),
            memory,
        })
    }
}

fn refuse(what: &str) -> Error {
    Error::Device {
        device: "virtual".into(),
        reason: format!("a planning device holds no data and computes nothing ({what})"),
    }
}

/// The buffer type of virtual devices: sizes without memory.
#[derive(Debug, Default)]
pub struct VirtualBufferType;

/// A buffer of a size and no bytes.
#[derive(Debug)]
pub struct VirtualBuffer {
    size: usize,
    usage: Mutex<BufferUsage>,
}

impl BufferType for VirtualBufferType {
    fn name(&self) -> String {
        "virtual".into()
    }
    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>> {
        Ok(Arc::new(VirtualBuffer {
            size,
            usage: Mutex::new(BufferUsage::Any),
        }))
    }
    fn alignment(&self) -> usize {
        64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Buffer for VirtualBuffer {
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(VirtualBufferType)
    }
    fn size(&self) -> usize {
        self.size
    }
    fn set_tensor(&self, _: &Layout, _: usize, _: &[u8], _: usize) -> Result<()> {
        Err(refuse("set_tensor"))
    }
    fn get_tensor(&self, _: &Layout, _: usize, _: &mut [u8], _: usize) -> Result<()> {
        Err(refuse("get_tensor"))
    }
    fn memset_tensor(&self, _: &Layout, _: usize, _: u8, _: usize, _: usize) -> Result<()> {
        // Placing a KV cache clears it; there is nothing to clear.
        Ok(())
    }
    fn clear(&self, _: u8) {}
    fn usage(&self) -> BufferUsage {
        *self.usage.lock()
    }
    fn set_usage(&self, usage: BufferUsage) {
        *self.usage.lock() = usage;
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The backend of a virtual device: it refuses to compute.
struct VirtualBackend {
    device: Arc<dyn Device>,
}

impl Backend for VirtualBackend {
    fn name(&self) -> String {
        self.device.name()
    }
    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn graph_compute(&self, _: &mut Graph) -> Result<()> {
        Err(refuse("graph_compute"))
    }
}

impl Device for VirtualDevice {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn description(&self) -> String {
        format!("planning device ({} bytes)", self.memory)
    }
    fn memory(&self) -> MemoryInfo {
        MemoryInfo {
            free: self.memory as usize,
            total: self.memory as usize,
        }
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(VirtualBufferType)
    }
    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(VirtualBackend {
            device: Arc::new(VirtualDevice {
                name: self.name.clone(),
                memory: self.memory,
            }),
        }))
    }
    fn supports_op(&self, _: &Graph, _: TensorId) -> std::result::Result<(), String> {
        Ok(())
    }
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        bt.as_any().is::<VirtualBufferType>()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
