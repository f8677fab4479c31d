//! Queues of device work, and events in them, as device-independent code holds them.
//!
//! The engine's saves copy device arrays on a [`Queue`] of their own (ordered after the caller's
//! work), and its streaming loads hand out an [`Event`] per group that completes when the group's
//! bytes are on the device. A backend whose devices have queues (CUDA's streams) makes them
//! ([`queue_after_current`](super::queue_after_current), [`record_event`](super::record_event));
//! devices without queues have neither, and their work is done when the call that does it returns.

use std::any::Any;
use std::fmt;

use crate::device::Device;
use crate::error::Result;

/// What a backend's queue does for a [`Queue`].
pub(crate) trait DeviceQueue: Send + Sync + fmt::Debug {
    /// Waits for the work enqueued so far.
    fn synchronize(&self) -> Result<()>;

    /// Makes the queue the calling thread's current one on its device (where the backend's
    /// operations enqueue their work); returns what [`DeviceQueue::leave`] restores.
    fn enter(&self) -> usize;

    /// Makes `previous` (what [`DeviceQueue::enter`] returned) current again.
    fn leave(&self, previous: usize);
}

/// A queue of one device's work (a CUDA stream) that dlbridge made for work of its own.
#[derive(Debug)]
pub struct Queue {
    device: Device,
    inner: Box<dyn DeviceQueue>,
}

impl Queue {
    #[cfg_attr(not(cuda), allow(dead_code))] // made by the backends with queues (CUDA)
    pub(crate) fn new(device: Device, inner: Box<dyn DeviceQueue>) -> Queue {
        Queue { device, inner }
    }

    /// The device whose work the queue runs.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Waits for the work enqueued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// Makes the queue the calling thread's current one on its device until the guard drops: the
    /// backend's operations called meanwhile (copies, kernels) enqueue their work here.
    pub fn enter(&self) -> Entered<'_> {
        Entered {
            queue: self,
            previous: self.inner.enter(),
        }
    }
}

/// A [`Queue`] current on this thread, until dropped ([`Queue::enter`]).
#[derive(Debug)]
#[must_use = "the queue is current only while the guard lives"]
pub struct Entered<'a> {
    queue: &'a Queue,
    previous: usize,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.queue.inner.leave(self.previous);
    }
}

/// What a backend's event does for an [`Event`].
pub(crate) trait DeviceEvent: Send + Sync + fmt::Debug {
    /// Waits on the host until the event completes.
    fn synchronize(&self) -> Result<()>;

    /// Whether the event has completed.
    fn query(&self) -> Result<bool>;

    /// The backend's own event, for [`Event::downcast`].
    fn as_any(&self) -> &dyn Any;

    /// The backend's own event, owned.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send + Sync>;
}

/// A point in a device's queue of work: it completes when the work enqueued before it has.
#[derive(Debug)]
pub struct Event {
    device: Device,
    inner: Box<dyn DeviceEvent>,
}

impl Event {
    #[cfg_attr(not(cuda), allow(dead_code))] // made by the backends with queues (CUDA)
    pub(crate) fn new(device: Device, inner: Box<dyn DeviceEvent>) -> Event {
        Event { device, inner }
    }

    /// The device whose queue the event is in.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Waits on the host until the event completes.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// Whether the event has completed (without waiting).
    pub fn query(&self) -> Result<bool> {
        self.inner.query()
    }

    /// The backend's own event (a [`cuda::Event`](super::cuda::Event) on CUDA devices), for callers that
    /// use the backend's API (a stream of the caller's waiting for it); `Err(self)` when it is
    /// another type.
    pub fn downcast<T: Any>(self) -> std::result::Result<T, Event> {
        if !self.inner.as_any().is::<T>() {
            return Err(self);
        }
        match self.inner.into_any().downcast::<T>() {
            Ok(event) => Ok(*event),
            Err(_) => unreachable!("the type was checked above"),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{self, cuda};
    use crate::{DType, Device, Tensor};

    #[test]
    fn devices_without_queues_have_neither_queues_nor_events() {
        assert!(backend::queue_after_current(Device::CPU).unwrap().is_none());
        assert!(backend::record_event(Device::CPU).unwrap().is_none());
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_cuda_queue_is_current_while_entered_and_its_work_is_ordered_after_the_callers() {
        let device = Device::cuda(0);
        let before = backend::current_stream(device);
        let src = Tensor::from_slice(&[3.0f32; 1 << 20], &[1 << 20]).unwrap();
        let on_device = src.copy_to(device).unwrap();
        let queue = backend::queue_after_current(device)
            .unwrap()
            .expect("CUDA has queues");
        assert_eq!(queue.device(), device);
        let back = Tensor::empty(&[1 << 20], DType::F32, Device::cuda_host(0)).unwrap();
        {
            let _entered = queue.enter();
            assert_ne!(backend::current_stream(device), before);
            // SAFETY: two allocations of one shape and dtype.
            unsafe { back.copy_from_unchecked(&on_device).unwrap() };
        }
        assert_eq!(backend::current_stream(device), before);
        let event = {
            let _entered = queue.enter();
            backend::record_event(device)
                .unwrap()
                .expect("CUDA has events")
        };
        event.synchronize().unwrap();
        assert!(event.query().unwrap());
        queue.synchronize().unwrap();
        assert!(back.to_vec::<f32>().unwrap().iter().all(|&v| v == 3.0));
        // The backend's own event comes back by its type, and only by it.
        let event = event.downcast::<cuda::Stream>().unwrap_err();
        let cuda_event = event.downcast::<cuda::Event>().unwrap();
        assert_eq!(cuda_event.device(), 0);
    }
}
