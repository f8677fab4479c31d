//! Streams, events, the per-thread current stream, and DLPack's stream handoff.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result::{DriverError, event, stream};
use cudarc::driver::sys;

use super::driver::Named;
use super::{BACKEND, context, driver};
use crate::error::{Error, Result};
use crate::pool::StreamKey;

/// The driver's handle for the legacy default stream.
pub const LEGACY_STREAM: usize = 1;
/// The driver's handle for the per-thread default stream.
pub const PER_THREAD_STREAM: usize = 2;

thread_local! {
    /// This thread's current stream per device, where set; the legacy default stream otherwise.
    static CURRENT: RefCell<Vec<(i32, usize)>> = const { RefCell::new(Vec::new()) };
}

/// The low bits of every pool key of a per-thread default stream (see [`pool_key`]). Real stream
/// handles never have them: they are aligned pointers, or `0`, `1` and `2`.
const PER_THREAD_KEY_TAG: StreamKey = 0b11;

thread_local! {
    /// The calling thread's pool key for its per-thread default stream.
    static PER_THREAD_KEY: StreamKey = {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        (NEXT.fetch_add(1, Ordering::Relaxed) << 2) | PER_THREAD_KEY_TAG
    };
}

/// The key under which the caching pool files blocks of stream `handle` used by the calling
/// thread: the handle itself, except for the per-thread default stream, which is a different
/// stream on every thread and so gets a key of its own on each.
pub(crate) fn pool_key(handle: usize) -> StreamKey {
    if handle == PER_THREAD_STREAM {
        PER_THREAD_KEY.with(|k| *k)
    } else {
        handle as StreamKey
    }
}

/// The stream handle through which the calling thread orders work against the stream of pool key
/// `key`: the handle itself; for a per-thread default stream, that stream when it is this
/// thread's, else the legacy default stream, which work on every blocking stream (another
/// thread's per-thread default stream among them) is ordered before and after.
pub(crate) fn handle_of_key(key: StreamKey) -> usize {
    if key & PER_THREAD_KEY_TAG != PER_THREAD_KEY_TAG {
        return key as usize;
    }
    if PER_THREAD_KEY.with(|k| *k) == key {
        PER_THREAD_STREAM
    } else {
        LEGACY_STREAM
    }
}

/// The calling thread's current stream on device `ordinal` (`0` is the legacy default stream).
pub fn current_stream(ordinal: i32) -> usize {
    CURRENT.with_borrow(|v| v.iter().find(|(d, _)| *d == ordinal).map_or(0, |&(_, s)| s))
}

/// Sets the calling thread's current stream on device `ordinal` and returns the previous one.
/// `0` and [`LEGACY_STREAM`] restore the legacy default stream.
pub fn set_current_stream(ordinal: i32, handle: usize) -> usize {
    let handle = if handle == LEGACY_STREAM { 0 } else { handle };
    CURRENT.with_borrow_mut(|v| match v.iter_mut().find(|(d, _)| *d == ordinal) {
        Some(slot) => std::mem::replace(&mut slot.1, handle),
        None => {
            v.push((ordinal, handle));
            0
        }
    })
}

/// The stream a DLPack consumer asked for, as the array API standard defines `stream` for CUDA:
/// `None` and `1` are the legacy default stream, `2` the per-thread default stream, `-1` means
/// "do not synchronize" (returned as `None`), larger values are stream handles; `0` is
/// disallowed because it is ambiguous.
pub(crate) fn stream_from_dlpack(stream: Option<i64>) -> Result<Option<usize>> {
    match stream {
        None | Some(1) => Ok(Some(LEGACY_STREAM)),
        Some(-1) => Ok(None),
        Some(0) => Err(Error::InvalidArgument(
            "stream=0 is ambiguous for CUDA and disallowed by the array API standard: pass 1 for \
             the legacy default stream, 2 for the per-thread default stream, or a stream handle"
                .into(),
        )),
        Some(s) if s > 1 => Ok(Some(s as usize)),
        Some(s) => Err(Error::InvalidArgument(format!(
            "stream={s} is not a CUDA stream: expected None, -1, 1, 2 or a stream handle"
        ))),
    }
}

fn same_stream(a: usize, b: usize) -> bool {
    let norm = |s: usize| if s == 0 { LEGACY_STREAM } else { s };
    norm(a) == norm(b)
}

/// The flags of a stream's wait for an event: none (the wait is enqueued on the stream).
pub(super) const WAIT_DEFAULT: sys::CUevent_wait_flags =
    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;

/// The driver's `CUstream` for a raw handle (`0` is the legacy default stream).
pub(super) fn raw(handle: usize) -> sys::CUstream {
    std::ptr::with_exposed_provenance_mut(handle)
}

/// Makes the work enqueued so far on `producer` visible to later work on `consumer` (both on
/// device `ordinal`), without blocking the host: an event recorded on `producer` and a wait for it
/// enqueued on `consumer`. Nothing happens when they are the same stream.
pub(crate) fn order_streams(ordinal: i32, producer: usize, consumer: usize) -> Result<()> {
    if same_stream(producer, consumer) {
        return Ok(());
    }
    order_across(ordinal, producer, ordinal, consumer)
}

/// As [`order_streams`], for a `producer` stream of device `from` and a `consumer` stream of
/// device `to` (a stream may wait for another device's event).
pub(super) fn order_across(from: i32, producer: usize, to: i32, consumer: usize) -> Result<()> {
    let ctx = context(from)?;
    // One event per device serves every handoff: a wait captures the event's state when it is
    // enqueued, so re-recording it later does not disturb earlier waits. The lock keeps a record
    // and its wait together.
    let event = ctx.handoff.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the event belongs to this device's context, which is current; the stream handle is
    // the producer's, whose validity the caller vouches for (a bad handle is reported by the
    // driver).
    unsafe { event::record(*event, raw(producer)) }.named("cuEventRecord")?;
    let _to = (to != from).then(|| context(to)).transpose()?;
    // SAFETY: a live event and the consumer's stream, of the context now current.
    unsafe { stream::wait_event(raw(consumer), *event, WAIT_DEFAULT) }.named("cuStreamWaitEvent")
}

/// As a DLPack producer: makes dlbridge's pending work on device `ordinal` (its current stream)
/// visible on the consumer's `stream` (already decoded by [`stream_from_dlpack`]).
pub(crate) fn make_visible(ordinal: i32, consumer: Option<usize>) -> Result<()> {
    match consumer {
        None => Ok(()),
        Some(consumer) => order_streams(ordinal, current_stream(ordinal), consumer),
    }
}

/// A CUDA stream: one dlbridge created (recycled for a later `Stream::new` when dropped, never
/// destroyed) or another library's handle (never destroyed here either).
#[derive(Debug)]
pub struct Stream {
    handle: usize,
    ordinal: i32,
    /// For streams dlbridge created: whether it is non-blocking.
    owned: Option<bool>,
}

/// Streams dlbridge created and no `Stream` holds any more, by (device, non-blocking). They are
/// never destroyed: memory released to the pool records a fence on the stream it was used on,
/// possibly after the `Stream` value is gone, so handles must stay valid for the process (as
/// PyTorch's stream pool does).
static SPARE_STREAMS: std::sync::Mutex<Vec<(i32, bool, usize)>> = std::sync::Mutex::new(Vec::new());

impl Stream {
    /// A new stream on device `ordinal`. A non-blocking stream does not synchronise with the
    /// legacy default stream (PyTorch's and CuPy's streams are non-blocking).
    pub fn new(ordinal: i32, non_blocking: bool) -> Result<Stream> {
        let _ctx = context(ordinal)?;
        {
            let mut spare = SPARE_STREAMS.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = spare
                .iter()
                .position(|&(d, nb, _)| d == ordinal && nb == non_blocking)
            {
                let (_, _, handle) = spare.swap_remove(i);
                return Ok(Stream {
                    handle,
                    ordinal,
                    owned: Some(non_blocking),
                });
            }
        }
        let kind = if non_blocking {
            stream::StreamKind::NonBlocking
        } else {
            stream::StreamKind::Default
        };
        let handle = stream::create(kind).named("cuStreamCreate")?;
        Ok(Stream {
            handle: handle.expose_provenance(),
            ordinal,
            owned: Some(non_blocking),
        })
    }

    /// Another library's stream on device `ordinal`, e.g. PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`. `0` and `1` name the legacy default stream and
    /// `2` the per-thread default stream.
    ///
    /// # Safety
    /// The handle must stay a valid stream of that device for as long as dlbridge uses it.
    pub unsafe fn from_raw(ordinal: i32, handle: usize) -> Result<Stream> {
        // Checks the driver and the device.
        let _ctx = context(ordinal)?;
        Ok(Stream {
            handle,
            ordinal,
            owned: None,
        })
    }

    /// The legacy default stream of device `ordinal`.
    pub fn legacy(ordinal: i32) -> Result<Stream> {
        // SAFETY: the legacy default stream is always valid.
        unsafe { Stream::from_raw(ordinal, 0) }
    }

    /// The raw handle (`0` for the legacy default stream).
    pub fn handle(&self) -> usize {
        self.handle
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.ordinal
    }

    /// Waits until all work enqueued on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        synchronize_stream(self.ordinal, self.handle)
    }

    /// Whether all work enqueued on the stream has finished.
    pub fn query(&self) -> Result<bool> {
        stream_idle(self.ordinal, self.handle)
    }

    /// Makes later work on this stream wait for `event` (without blocking the host).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let _ctx = context(self.ordinal)?;
        // SAFETY: a valid stream and event; the context is current.
        unsafe { stream::wait_event(raw(self.handle), event.handle, WAIT_DEFAULT) }
            .named("cuStreamWaitEvent")
    }
}

impl crate::backend::DeviceQueue for Stream {
    fn synchronize(&self) -> Result<()> {
        Stream::synchronize(self)
    }

    fn enter(&self) -> usize {
        set_current_stream(self.ordinal, self.handle)
    }

    fn leave(&self, previous: usize) {
        set_current_stream(self.ordinal, previous);
    }
}

impl crate::backend::DeviceEvent for Event {
    fn synchronize(&self) -> Result<()> {
        Event::synchronize(self)
    }

    fn query(&self) -> Result<bool> {
        Event::query(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Kept for reuse rather than destroyed: see `SPARE_STREAMS`.
        if let Some(non_blocking) = self.owned {
            SPARE_STREAMS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((self.ordinal, non_blocking, self.handle));
        }
    }
}

/// A CUDA event on one device.
#[derive(Debug)]
pub struct Event {
    handle: sys::CUevent,
    ordinal: i32,
    timing: bool,
}

// SAFETY: an event handle may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: every method goes through the thread-safe driver API.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on device `ordinal`; `timing` enables [`Event::elapsed_ms`].
    pub fn new(ordinal: i32, timing: bool) -> Result<Event> {
        let _ctx = context(ordinal)?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let handle = event::create(flags).named("cuEventCreate")?;
        Ok(Event {
            handle,
            ordinal,
            timing,
        })
    }

    /// Records the event on stream `stream` (a raw handle; `0` is the legacy default stream).
    pub fn record(&self, stream: usize) -> Result<()> {
        let _ctx = context(self.ordinal)?;
        // SAFETY: a valid event of the current context; the stream handle's validity is the
        // caller's (the driver reports a bad one).
        unsafe { event::record(self.handle, raw(stream)) }.named("cuEventRecord")
    }

    /// Waits until the work captured by the last record has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = context(self.ordinal)?;
        // SAFETY: a valid event.
        unsafe { event::synchronize(self.handle) }.named("cuEventSynchronize")
    }

    /// Whether the work captured by the last record has finished.
    pub fn query(&self) -> Result<bool> {
        let _ctx = context(self.ordinal)?;
        // SAFETY: a valid event.
        ready(unsafe { event::query(self.handle) }, "cuEventQuery")
    }

    /// Milliseconds between this event and `end`, both recorded and completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::InvalidArgument(
                "elapsed time needs two events created with timing enabled".into(),
            ));
        }
        if driver()?.version < 12080 {
            return Err(Error::BackendUnavailable {
                backend: BACKEND,
                reason: "event timing needs a CUDA 12.8 or newer driver".into(),
            });
        }
        let _ctx = context(self.ordinal)?;
        // SAFETY: two live events of this device; the driver has the entry point (checked above).
        unsafe { event::elapsed(self.handle, end.handle) }.named("cuEventElapsedTime")
    }

    /// The raw handle.
    pub fn handle(&self) -> usize {
        self.handle.expose_provenance()
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.ordinal
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_ctx) = context(self.ordinal) {
            // SAFETY: the event was created by `Event::new` and is destroyed only here.
            let _ = unsafe { event::destroy(self.handle) };
        }
    }
}

/// `Ok(true)` for success, `Ok(false)` for "not ready", an error otherwise.
pub(super) fn ready(result: std::result::Result<(), DriverError>, call: &str) -> Result<bool> {
    match result {
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
        result => result.named(call).map(|()| true),
    }
}

/// Whether every piece of work enqueued so far on stream `handle` of device `ordinal` has
/// finished (`cuStreamQuery`). The handle must be a live stream of the device, or a default
/// stream (the driver reports a bad one).
pub(crate) fn stream_idle(ordinal: i32, handle: usize) -> Result<bool> {
    let _ctx = context(ordinal)?;
    // SAFETY: a stream of the device (see above) whose context is current.
    ready(
        unsafe { driver::stream_query(raw(handle)) },
        "cuStreamQuery",
    )
}

/// Waits until every piece of work enqueued so far on stream `handle` of device `ordinal` has
/// finished (`cuStreamSynchronize`).
pub(crate) fn synchronize_stream(ordinal: i32, handle: usize) -> Result<()> {
    let _ctx = context(ordinal)?;
    // SAFETY: as in `stream_idle`.
    unsafe { stream::synchronize(raw(handle)) }.named("cuStreamSynchronize")
}

/// Makes work just enqueued on the calling thread's current stream that reads or writes
/// `tensors` visible to the streams their pooled blocks were allocated for, so that a block
/// released later is not handed out on its own stream while this work may still use it (what
/// PyTorch asks of its users with `record_stream`; here it is done for them). Tensors of other
/// devices, foreign memory and blocks of the current stream need nothing.
pub(crate) fn record_use<'a>(tensors: impl IntoIterator<Item = &'a crate::Tensor>) -> Result<()> {
    for t in tensors {
        let ordinal = t.device().index() as i32;
        record_use_on(ordinal, current_stream(ordinal), [t])?;
    }
    Ok(())
}

/// As [`record_use`], for work enqueued on stream `stream` of device `ordinal` (a copy runs on one
/// device's stream, and may touch memory of another device's pool).
pub(crate) fn record_use_on<'a>(
    ordinal: i32,
    stream: usize,
    tensors: impl IntoIterator<Item = &'a crate::Tensor>,
) -> Result<()> {
    record_buffer_use(ordinal, stream, tensors.into_iter().map(|t| t.buffer()))
}

/// As [`record_use_on`], for buffers: once per stream their blocks were allocated for.
pub(crate) fn record_buffer_use<'a>(
    ordinal: i32,
    stream: usize,
    buffers: impl IntoIterator<Item = &'a crate::buffer::Buffer>,
) -> Result<()> {
    let mut ordered: Vec<(i32, StreamKey)> = Vec::new();
    for b in buffers {
        let device = b.device();
        if !device.kind().is_cuda() {
            continue;
        }
        let Some(owner) = b.allocation_stream() else {
            continue;
        };
        let owner_ordinal = device.index() as i32;
        if ordered.contains(&(owner_ordinal, owner)) {
            continue;
        }
        ordered.push((owner_ordinal, owner));
        let owner = handle_of_key(owner);
        if owner_ordinal == ordinal {
            order_streams(ordinal, stream, owner)?;
        } else {
            order_across(ordinal, stream, owner_ordinal, owner)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_default_streams_get_a_pool_key_per_thread() {
        // Other handles are their own keys, and map back to themselves.
        for handle in [0, LEGACY_STREAM, 0x7f00_1234_5670] {
            assert_eq!(pool_key(handle), handle as StreamKey);
            assert_eq!(handle_of_key(handle as StreamKey), handle);
        }
        let here = pool_key(PER_THREAD_STREAM);
        assert_eq!(
            here & PER_THREAD_KEY_TAG,
            PER_THREAD_KEY_TAG,
            "never a real handle"
        );
        assert_eq!(pool_key(PER_THREAD_STREAM), here, "stable on one thread");
        assert_eq!(handle_of_key(here), PER_THREAD_STREAM);
        let there = std::thread::spawn(|| {
            let key = pool_key(PER_THREAD_STREAM);
            (key, handle_of_key(key))
        })
        .join()
        .unwrap();
        assert_ne!(there.0, here, "another thread, another stream");
        assert_eq!(
            there.1, PER_THREAD_STREAM,
            "its own per-thread stream there"
        );
        // Here, another thread's per-thread stream is reached through the legacy default stream.
        assert_eq!(handle_of_key(there.0), LEGACY_STREAM);
    }
}
