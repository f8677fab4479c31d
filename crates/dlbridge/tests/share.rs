//! Arrays across processes: shareable memory, handles, descriptor passing, and the lifetime rules
//! (a consumer outlives its producer; an exported block is never reused under a consumer).
//!
//! Cross-process tests re-run this test binary as the other process (`CHILD` names its role) and
//! talk to it over a Unix socket, handles travelling with `SCM_RIGHTS`. CUDA tests are
//! `#[ignore = "needs a CUDA device"]`: a GPU machine runs them with `-- --include-ignored`.

mod common;
use common::gpu;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command};

use dlbridge::share::{self, SharedHandle, SharedKind};
use dlbridge::{DType, Device, Error, SliceArg, Tensor};

/// The environment variable naming a child's role.
const CHILD: &str = "DLBRIDGE_SHARE_CHILD";
/// The environment variable naming the socket a child connects to.
const SOCKET: &str = "DLBRIDGE_SHARE_SOCKET";

fn socket_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("dlbridge-share-{}-{tag}.sock", std::process::id()))
}

/// Starts this binary as the child `role` running test `test`, and accepts its connection.
fn spawn(test: &str, role: &str) -> (Child, UnixStream) {
    spawn_with(test, role, &[])
}

/// [`spawn`] with more environment variables for the child.
fn spawn_with(test: &str, role: &str, env: &[(&str, &str)]) -> (Child, UnixStream) {
    let path = socket_path(role);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--include-ignored"])
        .env(CHILD, role)
        .env(SOCKET, &path)
        .envs(env.iter().copied())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    let _ = std::fs::remove_file(&path);
    (child, stream)
}

/// In a child: its role and its connection, or `None` in the parent.
fn child() -> Option<(String, UnixStream)> {
    let role = std::env::var(CHILD).ok()?;
    let stream = UnixStream::connect(std::env::var(SOCKET).unwrap()).unwrap();
    Some((role, stream))
}

/// One byte of acknowledgement on a socket.
fn ack(s: &UnixStream) {
    use std::io::Write;
    (&*s).write_all(b"k").unwrap();
}

fn wait_ack(s: &UnixStream) {
    use std::io::Read;
    let mut b = [0u8; 1];
    (&*s).read_exact(&mut b).unwrap();
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn share_and_open_in_one_process_is_zero_copy() {
    let t =
        share::to_shareable(&Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap()).unwrap();
    let h = share::share(&t, false).unwrap();
    assert_eq!(h.kind(), SharedKind::HostFile);
    assert_eq!(h.dtype(), DType::F32);
    let mut opened = share::open(h).unwrap();
    assert_eq!(opened.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    // Two mappings of one file: a write through one is seen through the other.
    opened.as_mut_slice::<f32>().unwrap()[2] = 30.0;
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 30.0, 4.0]);
}

#[test]
fn views_keep_offset_and_strides() {
    let data: Vec<i32> = (0..24).collect();
    let t = share::to_shareable(&Tensor::from_slice(&data, &[4, 6]).unwrap()).unwrap();
    let v = t
        .slice(0, SliceArg::range(1, 4))
        .unwrap()
        .slice(
            1,
            SliceArg {
                start: Some(1),
                stop: None,
                step: 2,
            },
        )
        .unwrap()
        .transpose()
        .unwrap();
    let opened = share::open(share::share(&v, false).unwrap()).unwrap();
    assert_eq!(opened.shape(), v.shape());
    assert_eq!(opened.strides(), v.strides());
    assert_eq!(opened.byte_offset() % 4, 0);
    assert_eq!(opened.to_vec::<i32>().unwrap(), v.to_vec::<i32>().unwrap());
}

#[test]
fn memory_that_is_not_shareable_is_copied_once_or_refused() {
    let t = Tensor::from_slice(&[5u8, 6, 7], &[3]).unwrap();
    let refused = share::share(&t, false).unwrap_err();
    assert!(matches!(refused, Error::CopyRequired(_)), "{refused}");
    let opened = share::open(share::share(&t, true).unwrap()).unwrap();
    assert_eq!(opened.to_vec::<u8>().unwrap(), vec![5, 6, 7]);
    assert_ne!(opened.buffer().handle(), t.buffer().handle());
}

#[test]
fn handles_round_trip_through_bytes_and_reject_garbage() {
    let t = share::to_shareable(&Tensor::from_slice(&[1i64, 2], &[2]).unwrap()).unwrap();
    let mut h = share::share(&t.clone().into_read_only(), false).unwrap();
    let bytes = h.to_bytes();
    let fd = h.take_fd();
    let back = SharedHandle::from_bytes(&bytes, fd).unwrap();
    assert!(back.is_read_only());
    let opened = share::open(back).unwrap();
    assert!(opened.is_read_only());
    assert_eq!(opened.to_vec::<i64>().unwrap(), vec![1, 2]);

    assert!(matches!(
        SharedHandle::from_bytes(b"nonsense", None),
        Err(Error::InvalidArgument(_))
    ));
    // A handle of host memory is nothing without its descriptor.
    assert!(SharedHandle::from_bytes(&bytes, None).is_err());
    // Truncated bytes.
    assert!(SharedHandle::from_bytes(&bytes[..bytes.len() - 3], None).is_err());
}

#[test]
fn a_handle_of_another_boot_or_another_file_is_refused() {
    let t = share::to_shareable(&Tensor::from_slice(&[1u16, 2, 3], &[3]).unwrap()).unwrap();
    // Another boot: the boot id in the bytes differs from this machine's.
    let mut h = share::share(&t, false).unwrap();
    let mut bytes = h.to_bytes();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let at = bytes
        .windows(boot.trim().len())
        .position(|w| w == boot.trim().as_bytes())
        .unwrap();
    bytes[at] = if bytes[at] == b'0' { b'1' } else { b'0' };
    let other_boot = SharedHandle::from_bytes(&bytes, h.take_fd()).unwrap();
    let err = share::open(other_boot).unwrap_err();
    assert!(err.to_string().contains("another boot"), "{err}");

    // Another file behind the descriptor: the inode check refuses it.
    let h = share::share(&t, false).unwrap();
    let bytes = h.to_bytes();
    let other = share::to_shareable(&Tensor::from_slice(&[9u16; 3], &[3]).unwrap()).unwrap();
    let mut other_handle = share::share(&other, false).unwrap();
    let wrong = SharedHandle::from_bytes(&bytes, other_handle.take_fd()).unwrap();
    let err = share::open(wrong).unwrap_err();
    assert!(
        err.to_string().contains("not the handle's shared file"),
        "{err}"
    );
}

#[test]
fn an_exported_block_is_never_reused_under_a_consumer() {
    let n = 1 << 16;
    let t = share::allocate(Device::CPU, n, true).unwrap();
    let t = Tensor::new(t, DType::U8, dlbridge::Layout::contiguous(&[n]).unwrap()).unwrap();
    let addr = t.buffer().handle();
    // SAFETY: the only handle to the buffer's bytes.
    unsafe { t.fill_bytes_unchecked(&[7]) }.unwrap();
    let opened = share::open(share::share(&t, false).unwrap()).unwrap();
    drop(t);
    // The pool hands the same addresses out again, now backed by a fresh file.
    let again = share::allocate(Device::CPU, n, true).unwrap();
    assert_eq!(again.handle(), addr);
    let again = Tensor::new(
        again,
        DType::U8,
        dlbridge::Layout::contiguous(&[n]).unwrap(),
    )
    .unwrap();
    // SAFETY: the only handle to the buffer's bytes.
    unsafe { again.fill_bytes_unchecked(&[1]) }.unwrap();
    assert!(opened.to_vec::<u8>().unwrap().iter().all(|&b| b == 7));
}

#[test]
fn nothing_leaks_in_this_process() {
    let before = open_fds();
    for _ in 0..50 {
        let t = share::to_shareable(&Tensor::from_slice(&[1.0f64; 100], &[100]).unwrap()).unwrap();
        let opened = share::open(share::share(&t, false).unwrap()).unwrap();
        assert_eq!(opened.to_vec::<f64>().unwrap()[99], 1.0);
    }
    share::pool(Device::CPU).unwrap().clear_cache();
    // Other tests run beside this one: allow their few descriptors.
    assert!(open_fds() <= before + 8, "{before} -> {}", open_fds());
}

#[test]
fn a_write_in_one_process_is_seen_by_the_other() {
    if let Some((role, s)) = child() {
        if role != "writer" {
            return;
        }
        let mut t = share::open(share::recv_handle(&s).unwrap()).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        t.as_mut_slice::<f32>().unwrap()[1] = 42.0;
        ack(&s);
        return;
    }
    let t = share::to_shareable(&Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap()).unwrap();
    let (mut proc_, s) = spawn("a_write_in_one_process_is_seen_by_the_other", "writer");
    share::send_handle(&s, share::share(&t, false).unwrap()).unwrap();
    wait_ack(&s);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 42.0, 3.0]);
    assert!(proc_.wait().unwrap().success());
}

#[test]
fn a_consumer_outlives_its_producer() {
    if let Some((role, s)) = child() {
        if role != "producer" {
            return;
        }
        let data: Vec<u32> = (0..1000).collect();
        let t = share::to_shareable(&Tensor::from_slice(&data, &[10, 100]).unwrap()).unwrap();
        let view = t.slice(0, SliceArg::range(2, 5)).unwrap();
        share::send_handle(&s, share::share(&view, false).unwrap()).unwrap();
        wait_ack(&s);
        return; // the producer exits; its memory must stay for the consumer
    }
    let (mut producer, s) = spawn("a_consumer_outlives_its_producer", "producer");
    let t = share::open(share::recv_handle(&s).unwrap()).unwrap();
    ack(&s);
    assert!(producer.wait().unwrap().success());
    let expect: Vec<u32> = (200..500).collect();
    assert_eq!(t.shape(), &[3, 100]);
    assert_eq!(t.to_vec::<u32>().unwrap(), expect);
}

#[test]
fn a_killed_consumer_leaks_nothing() {
    if let Some((role, s)) = child() {
        if role != "victim" {
            return;
        }
        let t = share::open(share::recv_handle(&s).unwrap()).unwrap();
        assert_eq!(t.numel(), 1 << 20);
        ack(&s);
        std::thread::sleep(std::time::Duration::from_secs(60));
        return;
    }
    let t =
        share::to_shareable(&Tensor::zeros(&[1 << 20], DType::U8, Device::CPU).unwrap()).unwrap();
    let (mut victim, s) = spawn("a_killed_consumer_leaks_nothing", "victim");
    share::send_handle(&s, share::share(&t, false).unwrap()).unwrap();
    wait_ack(&s);
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    // The consumer's mapping died with it; nothing is named in /dev/shm.
    let named = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().contains("dlbridge"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(named, 0);
}

#[test]
fn descriptors_travel_over_a_socket() {
    let (a, b) = UnixStream::pair().unwrap();
    let t = share::to_shareable(&Tensor::from_slice(&[3i8, 4], &[2]).unwrap()).unwrap();
    let mut h = share::share(&t, false).unwrap();
    let fd = h.take_fd().unwrap();
    share::send_fds(&a, &h.to_bytes(), &[std::os::fd::AsFd::as_fd(&fd)]).unwrap();
    let mut buf = vec![0u8; 4096];
    let (n, mut fds) = share::recv_fds(&b, &mut buf).unwrap();
    assert_eq!(fds.len(), 1);
    let back = SharedHandle::from_bytes(&buf[..n], fds.pop()).unwrap();
    assert_eq!(
        share::open(back).unwrap().to_vec::<i8>().unwrap(),
        vec![3, 4]
    );
    // Too many descriptors for one message.
    let many: Vec<_> = (0..17).map(|_| std::os::fd::AsFd::as_fd(&fd)).collect();
    assert!(share::send_fds(&a, b"x", &many).is_err());
}

/// Sends a handle's bytes alone (no descriptor beside them), after their length.
fn send_bytes(s: &UnixStream, bytes: &[u8]) {
    use std::io::Write;
    (&*s)
        .write_all(&(bytes.len() as u32).to_le_bytes())
        .unwrap();
    (&*s).write_all(bytes).unwrap();
}

fn recv_bytes(s: &UnixStream) -> Vec<u8> {
    use std::io::Read;
    let mut len = [0u8; 4];
    (&*s).read_exact(&mut len).unwrap();
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    (&*s).read_exact(&mut buf).unwrap();
    buf
}

#[test]
fn a_handle_sent_as_bytes_alone_is_claimed_from_its_producer() {
    use share::broker;
    if let Some((role, s)) = child() {
        if role != "claimer" {
            return;
        }
        // Opened: the descriptor is claimed from the producer's lender.
        let mut t = share::open(SharedHandle::from_bytes(&recv_bytes(&s), None).unwrap()).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        t.as_mut_slice::<f32>().unwrap()[2] = 7.0;
        // Dropped unopened: the producer is told, and closes what it kept.
        drop(SharedHandle::from_bytes(&recv_bytes(&s), None).unwrap());
        ack(&s);
        return;
    }
    let _lending = lending();
    let t = share::to_shareable(&Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap()).unwrap();
    let before = broker::outstanding();
    let (mut claimer, s) = spawn(
        "a_handle_sent_as_bytes_alone_is_claimed_from_its_producer",
        "claimer",
    );
    let mut h = share::share(&t, false).unwrap();
    let first = h.to_bytes_lent().unwrap();
    let unopened = h.to_bytes_lent().unwrap();
    assert_eq!(broker::outstanding(), before + 2);
    assert!(
        h.fd().is_some(),
        "lending keeps the handle's own descriptor"
    );
    send_bytes(&s, &first);
    send_bytes(&s, &unopened);
    wait_ack(&s);
    assert!(claimer.wait().unwrap().success());
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 7.0]);
    settles_to(before);
}

/// Serialises the tests of this process that lend descriptors or count them: the count of lent
/// descriptors is the process's, and tests run in parallel threads.
fn lending() -> std::sync::MutexGuard<'static, ()> {
    static LENDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LENDING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits (at most 10 s) for this process's lent descriptors to come back to `count`: a forgo is a
/// message the lender's thread handles after the receiver moved on.
fn settles_to(count: usize) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while share::broker::outstanding() != count && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        share::broker::outstanding(),
        count,
        "every lent descriptor was claimed or forgone"
    );
}

#[test]
fn a_handle_sent_as_bytes_needs_its_producer_alive() {
    if let Some((role, s)) = child() {
        if role != "leaver" {
            return;
        }
        let t = share::to_shareable(&Tensor::from_slice(&[5u8; 8], &[8]).unwrap()).unwrap();
        send_bytes(
            &s,
            &share::share(&t, false).unwrap().to_bytes_lent().unwrap(),
        );
        return; // exits with the descriptor unclaimed
    }
    let (mut leaver, s) = spawn("a_handle_sent_as_bytes_needs_its_producer_alive", "leaver");
    let bytes = recv_bytes(&s);
    assert!(leaver.wait().unwrap().success());
    let err = share::open(SharedHandle::from_bytes(&bytes, None).unwrap()).unwrap_err();
    assert!(err.to_string().contains("has exited"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// CUDA: run on a GPU machine with `-- --include-ignored`.

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_vmm_write_is_seen_across_processes_and_outlives_the_producer() {
    if let Some((role, s)) = child() {
        if role != "cuda-producer" {
            return;
        }
        let host: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let t = Tensor::from_slice(&host, &[64, 64])
            .unwrap()
            .copy_to(gpu())
            .unwrap();
        let h = share::share(&t, true).unwrap();
        assert_eq!(h.kind(), SharedKind::CudaVmm);
        share::send_handle(&s, h).unwrap();
        wait_ack(&s);
        return;
    }
    let (mut producer, s) = spawn(
        "cuda_vmm_write_is_seen_across_processes_and_outlives_the_producer",
        "cuda-producer",
    );
    let t = share::open(share::recv_handle(&s).unwrap()).unwrap();
    ack(&s);
    assert!(producer.wait().unwrap().success());
    let back = t.copy_to(Device::CPU).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(back[4095], 4095.0);
}

/// A VMM handle sent as bytes alone: its descriptor is claimed when the receiver first maps the
/// allocation, and forgone by a second handle of the same allocation, which opens as the same
/// mapping.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_vmm_handles_sent_as_bytes_claim_once_per_mapping() {
    use share::broker;
    if let Some((role, s)) = child() {
        if role != "cuda-claimer" {
            return;
        }
        let a = share::open(SharedHandle::from_bytes(&recv_bytes(&s), None).unwrap()).unwrap();
        let b = share::open(SharedHandle::from_bytes(&recv_bytes(&s), None).unwrap()).unwrap();
        assert_eq!(
            a.buffer().handle(),
            b.buffer().handle(),
            "one mapping of one allocation"
        );
        assert_eq!(on_host(&b)[..4], [0.0, 1.0, 2.0, 3.0]);
        ack(&s);
        return;
    }
    let _lending = lending();
    let host: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    let t = share::to_shareable(
        &Tensor::from_slice(&host, &[1024])
            .unwrap()
            .copy_to(gpu())
            .unwrap(),
    )
    .unwrap();
    let before = broker::outstanding();
    let (mut claimer, s) = spawn(
        "cuda_vmm_handles_sent_as_bytes_claim_once_per_mapping",
        "cuda-claimer",
    );
    for _ in 0..2 {
        let mut h = share::share(&t, false).unwrap();
        assert_eq!(h.kind(), SharedKind::CudaVmm);
        send_bytes(&s, &h.to_bytes_lent().unwrap());
    }
    wait_ack(&s);
    assert!(claimer.wait().unwrap().success());
    settles_to(before);
}

/// A receiver keeps a small mapping after its last array goes, so that the same memory sent again
/// maps at once (the same address, no descriptor claimed); `empty_cache` lets go of it (its
/// descriptor closes: counted in the receiver, a process running this test alone).
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_a_released_small_mapping_is_kept_until_empty_cache() {
    if let Some((role, s)) = child() {
        if role != "cuda-keeper" {
            return;
        }
        let a = share::open(SharedHandle::from_bytes(&recv_bytes(&s), None).unwrap()).unwrap();
        let first = a.buffer().handle();
        drop(a);
        let b = share::open(SharedHandle::from_bytes(&recv_bytes(&s), None).unwrap()).unwrap();
        assert_eq!(b.buffer().handle(), first, "the kept mapping is reused");
        drop(b);
        let kept = open_fds();
        dlbridge::empty_cache(gpu()).unwrap();
        assert_eq!(
            open_fds(),
            kept - 1,
            "empty_cache released the kept mapping"
        );
        ack(&s);
        return;
    }
    let _lending = lending();
    let (mut keeper, s) = spawn(
        "cuda_a_released_small_mapping_is_kept_until_empty_cache",
        "cuda-keeper",
    );
    let t = share::to_shareable(&Tensor::zeros(&[1 << 20], DType::U8, gpu()).unwrap()).unwrap();
    for _ in 0..2 {
        send_bytes(
            &s,
            &share::share(&t, false).unwrap().to_bytes_lent().unwrap(),
        );
    }
    wait_ack(&s);
    assert!(keeper.wait().unwrap().success());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_pinned_memory_is_shared() {
    let device = Device::cuda_host(gpu().index());
    let buffer = share::allocate(device, 16, true).unwrap();
    let t = Tensor::new(
        buffer,
        DType::U32,
        dlbridge::Layout::contiguous(&[4]).unwrap(),
    )
    .unwrap();
    let h = share::share(&t, false).unwrap();
    assert_eq!(h.kind(), SharedKind::HostFile);
    let mut opened = share::open(h).unwrap();
    opened.as_mut_slice::<u32>().unwrap()[3] = 9;
    assert_eq!(t.to_vec::<u32>().unwrap(), vec![0, 0, 0, 9]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_ordinary_memory_goes_through_legacy_ipc_without_a_copy() {
    if let Some((role, s)) = child() {
        if role != "legacy" {
            return;
        }
        let t = share::open(share::recv_handle(&s).unwrap()).unwrap();
        assert_eq!(
            t.copy_to(Device::CPU).unwrap().to_vec::<i32>().unwrap(),
            vec![5, 6, 7]
        );
        ack(&s);
        return;
    }
    let t = Tensor::from_slice(&[5i32, 6, 7], &[3])
        .unwrap()
        .copy_to(gpu())
        .unwrap();
    let h = share::share(&t, false).unwrap();
    assert_eq!(h.kind(), SharedKind::CudaIpc);
    let (mut child_, s) = spawn(
        "cuda_ordinary_memory_goes_through_legacy_ipc_without_a_copy",
        "legacy",
    );
    share::send_handle(&s, h).unwrap();
    wait_ack(&s);
    assert!(child_.wait().unwrap().success());
}

#[test]
fn an_opened_array_is_shared_on_without_a_copy() {
    let t = share::to_shareable(&Tensor::from_slice(&[1u8, 2, 3, 4], &[4]).unwrap()).unwrap();
    let first = share::open(share::share(&t, false).unwrap()).unwrap();
    let view = first.slice(0, SliceArg::range(1, 3)).unwrap();
    let mut second = share::open(share::share(&view, false).unwrap()).unwrap();
    second.as_mut_slice::<u8>().unwrap()[0] = 20;
    assert_eq!(t.to_vec::<u8>().unwrap(), vec![1, 20, 3, 4]);
}

/// `n` copies of `value` on `device`.
fn filled(value: f32, n: usize, device: Device) -> Tensor {
    Tensor::from_slice(&vec![value; n], &[n])
        .unwrap()
        .copy_to(device)
        .unwrap()
}

fn on_host(t: &Tensor) -> Vec<f32> {
    t.copy_to(Device::CPU).unwrap().to_vec::<f32>().unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_an_opened_vmm_array_is_shared_on_as_the_same_memory() {
    let device = gpu();
    let n = 1024;
    // The producer's own mapping of a pool block, and an import of it: two mappings of one
    // allocation in this process.
    let pooled = share::to_shareable(&filled(0.0, n, device)).unwrap();
    let h = share::share(&pooled, false).unwrap();
    assert_eq!(h.kind(), SharedKind::CudaVmm);
    let mut first = share::open(h).unwrap();
    assert_ne!(first.buffer().handle(), pooled.buffer().handle());
    first.copy_from(&filled(1.0, n, device)).unwrap();
    assert_eq!(on_host(&pooled), vec![1.0; n], "a write through the import");

    // Sharing the opened array again, copy refused: were the import not recognised as VMM
    // memory this would be a legacy IPC handle (or, with copies allowed, a copy).
    let again = share::share(&first, false).unwrap();
    assert_eq!(again.kind(), SharedKind::CudaVmm);
    assert_eq!(again.allocation_len(), first.buffer().len());
    let mut second = share::open(again).unwrap();
    // The allocation is mapped once per process: the same addresses.
    assert_eq!(second.buffer().handle(), first.buffer().handle());
    second.copy_from(&filled(2.0, n, device)).unwrap();
    assert_eq!(on_host(&first), vec![2.0; n]);
    assert_eq!(on_host(&pooled), vec![2.0; n]);

    // A view of the opened array, shared with copies allowed: still no copy.
    let view = first.slice(0, SliceArg::range(8, 16)).unwrap();
    let mut third = share::open(share::share(&view, true).unwrap()).unwrap();
    assert_eq!(third.buffer().handle(), first.buffer().handle());
    third.copy_from(&filled(3.0, 8, device)).unwrap();
    let seen = on_host(&pooled);
    assert_eq!(&seen[8..16], &[3.0; 8]);
    assert_eq!(seen[7], 2.0);
    assert_eq!(seen[16], 2.0);

    // Once every opened buffer is gone, a new open imports afresh, the same memory still.
    let h = share::share(&first, false).unwrap();
    drop((first, second, third, view));
    let fourth = share::open(h).unwrap();
    assert_eq!(on_host(&fourth)[8], 3.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_an_opened_array_sent_on_is_written_and_read_in_both_directions() {
    if let Some((role, s)) = child() {
        if role != "cuda-reshared" {
            return;
        }
        let mut t = share::open(share::recv_handle(&s).unwrap()).unwrap();
        assert_eq!(
            on_host(&t),
            vec![4.0; 1024],
            "the parent's write, read here"
        );
        t.copy_from(&filled(5.0, 1024, t.device())).unwrap();
        dlbridge::backend::synchronize(t.device()).unwrap();
        ack(&s);
        wait_ack(&s);
        return;
    }
    let device = gpu();
    // As `open_shared(zeros(...).share())`: the parent holds an import, not a pool block.
    let mut a = share::open(share::share(&filled(0.0, 1024, device), true).unwrap()).unwrap();
    a.copy_from(&filled(4.0, 1024, device)).unwrap();
    let h = share::share(&a, false).unwrap();
    assert_eq!(h.kind(), SharedKind::CudaVmm);
    let (mut child_, s) = spawn(
        "cuda_an_opened_array_sent_on_is_written_and_read_in_both_directions",
        "cuda-reshared",
    );
    share::send_handle(&s, h).unwrap();
    wait_ack(&s);
    assert_eq!(on_host(&a), vec![5.0; 1024], "the child's write, read here");
    ack(&s);
    assert!(child_.wait().unwrap().success());
}

// ---------------------------------------------------------------------------------------------
// Many arrays at once.

#[test]
fn many_small_arrays_are_packed_into_one_allocation() {
    let arrays: Vec<Tensor> = (0..100)
        .map(|i| Tensor::from_slice(&[i as f32, -(i as f32)], &[2]).unwrap())
        .collect();
    let group = share::share_many(&arrays, true).unwrap();
    assert_eq!(
        group.handles.len(),
        1,
        "one block (one descriptor) for every copied array"
    );
    let mut offsets: Vec<usize> = group.views.iter().map(|v| v.layout.byte_offset()).collect();
    offsets.dedup();
    assert_eq!(offsets.len(), 100, "every array has its own slot");
    assert!(offsets.iter().all(|o| o % 256 == 0));
    let opened = share::open_many(group).unwrap();
    assert_eq!(opened.len(), 100);
    for (i, t) in opened.iter().enumerate() {
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![i as f32, -(i as f32)]);
        assert_eq!(
            t.buffer().handle(),
            opened[0].buffer().handle(),
            "one mapping"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_many_small_arrays_are_packed_into_one_block() {
    let dev = Device::cuda(0);
    let mut arrays: Vec<Tensor> = (0..300)
        .map(|i| {
            let v = [i as f32, -(i as f32), 0.5];
            Tensor::from_slice(&v, &[3]).unwrap().copy_to(dev).unwrap()
        })
        .collect();
    // A strided view and an empty one among them.
    let m: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let m = Tensor::from_slice(&m, &[3, 4])
        .unwrap()
        .copy_to(dev)
        .unwrap();
    arrays.push(m.index(1, 1).unwrap());
    arrays.push(m.slice(0, SliceArg::range(1, 1)).unwrap());
    let group = share::share_many(&arrays, true).unwrap();
    assert_eq!(group.handles.len(), 1, "one block for every copied array");
    let opened = share::open_many(group).unwrap();
    let host = |t: &Tensor| t.copy_to(Device::CPU).unwrap().to_vec::<f32>().unwrap();
    for (i, t) in opened.iter().take(300).enumerate() {
        assert_eq!(host(t), vec![i as f32, -(i as f32), 0.5], "array {i}");
    }
    assert_eq!(host(&opened[300]), vec![1.0, 5.0, 9.0]);
    assert_eq!(opened[301].shape(), &[0, 4]);
}

#[test]
fn views_of_one_shareable_allocation_share_one_handle_and_see_writes() {
    let data: Vec<i32> = (0..24).collect();
    let base = share::to_shareable(&Tensor::from_slice(&data, &[4, 6]).unwrap()).unwrap();
    let rows: Vec<Tensor> = (0..4)
        .map(|r| base.slice(0, SliceArg::range(r, r + 1)).unwrap())
        .chain([base.transpose().unwrap(), base.clone().into_read_only()])
        .collect();
    let group = share::share_many(&rows, false).unwrap();
    assert_eq!(
        group.handles.len(),
        1,
        "views of one allocation: one handle"
    );
    assert!(group.views[5].read_only && !group.views[0].read_only);
    let opened = share::open_many(group).unwrap();
    for (got, want) in opened.iter().zip(&rows) {
        assert_eq!(got.shape(), want.shape());
        assert_eq!(got.strides(), want.strides());
        assert_eq!(got.to_vec::<i32>().unwrap(), want.to_vec::<i32>().unwrap());
    }
    assert!(opened[5].is_read_only());
    // The same memory: a write through an opened row is seen in the producer's array.
    let row: Vec<i32> = (0..6).map(|i| -i).collect();
    let row_t = Tensor::from_slice(&row, &[1, 6]).unwrap();
    // SAFETY: the opened views alias one mapping; nothing reads row 2 during the write.
    unsafe { opened[2].copy_from_unchecked(&row_t) }.unwrap();
    assert_eq!(base.to_vec::<i32>().unwrap()[12..18], row[..]);
}

#[test]
fn share_many_mixes_packed_and_shared_and_keeps_order() {
    let shareable = share::to_shareable(&Tensor::from_slice(&[7u16, 8, 9], &[3]).unwrap()).unwrap();
    let empty = Tensor::from_slice::<f64>(&[], &[0, 3]).unwrap();
    let scalar = Tensor::from_slice(&[42i8], &[]).unwrap();
    let strided = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])
        .unwrap()
        .transpose()
        .unwrap();
    let arrays = [
        scalar.clone(),
        shareable.clone(),
        empty.clone(),
        strided.clone(),
    ];
    let group = share::share_many(&arrays, true).unwrap();
    assert_eq!(
        group.handles.len(),
        2,
        "the packed block and the shareable array's"
    );
    let opened = share::open_many(group).unwrap();
    assert_eq!(opened[0].shape(), &[] as &[usize]);
    assert_eq!(opened[0].to_vec::<i8>().unwrap(), vec![42]);
    assert_eq!(opened[1].to_vec::<u16>().unwrap(), vec![7, 8, 9]);
    assert_eq!(opened[2].shape(), &[0, 3]);
    assert_eq!(opened[3].shape(), &[3, 2]);
    assert!(opened[3].is_contiguous(), "a copied view arrives compact");
    assert_eq!(
        opened[3].to_vec::<f32>().unwrap(),
        strided.to_vec::<f32>().unwrap()
    );
}

#[test]
fn share_many_refuses_a_copy_when_told_not_to_and_rejects_bad_views() {
    let t = Tensor::from_slice(&[1u8], &[1]).unwrap();
    let err = share::share_many(&[t], false).unwrap_err();
    assert!(matches!(err, Error::CopyRequired(_)), "{err}");

    let ok = share::to_shareable(&Tensor::from_slice(&[1u8, 2], &[2]).unwrap()).unwrap();
    let mut group = share::share_many(std::slice::from_ref(&ok), false).unwrap();
    group.views[0].handle = 3;
    let err = share::open_many(group).unwrap_err();
    assert!(err.to_string().contains("names handle 3"), "{err}");

    let mut group = share::share_many(&[ok], false).unwrap();
    let len = group.handles[0].allocation_len();
    group.views[0].layout = dlbridge::Layout::contiguous_at(&[2], len).unwrap();
    let err = share::open_many(group).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds(_)), "{err}");
    assert!(share::share_many(&[], true).unwrap().handles.is_empty());
}

#[test]
fn a_group_is_opened_in_another_process() {
    if let Some((role, s)) = child() {
        if role != "group" {
            return;
        }
        use std::io::Read;
        let mut n = [0u8; 8];
        (&s).read_exact(&mut n).unwrap();
        let n = u64::from_le_bytes(n) as usize;
        let mut handles = Vec::new();
        for _ in 0..n {
            handles.push(share::recv_handle(&s).unwrap());
        }
        // The views travel as (handle, offset) pairs of f32 arrays of 3.
        let mut raw = vec![0u8; 16 * 5];
        (&s).read_exact(&mut raw).unwrap();
        let views = raw
            .chunks(16)
            .map(|c| share::SharedView {
                handle: u64::from_le_bytes(c[..8].try_into().unwrap()) as usize,
                dtype: DType::F32,
                layout: dlbridge::Layout::contiguous_at(
                    &[3],
                    u64::from_le_bytes(c[8..].try_into().unwrap()) as usize,
                )
                .unwrap(),
                read_only: false,
            })
            .collect();
        let opened = share::open_many(share::SharedGroup { handles, views }).unwrap();
        for (i, t) in opened.iter().enumerate() {
            assert_eq!(t.to_vec::<f32>().unwrap(), vec![i as f32; 3]);
            let first = t.slice(0, SliceArg::range(0, 1)).unwrap();
            let value = Tensor::from_slice(&[100.0 + i as f32], &[1]).unwrap();
            // SAFETY: the views are disjoint and nothing else touches the memory meanwhile.
            unsafe { first.copy_from_unchecked(&value) }.unwrap();
        }
        ack(&s);
        return;
    }
    // Arrays in shareable memory, so the producer sees the child's writes in its own.
    let arrays: Vec<Tensor> = (0..5)
        .map(|i| share::to_shareable(&filled(i as f32, 3, Device::CPU)).unwrap())
        .collect();
    let group = share::share_many(&arrays, false).unwrap();
    let (mut child_, s) = spawn("a_group_is_opened_in_another_process", "group");
    use std::io::Write;
    (&s).write_all(&(group.handles.len() as u64).to_le_bytes())
        .unwrap();
    let mut raw = Vec::new();
    for v in &group.views {
        raw.extend_from_slice(&(v.handle as u64).to_le_bytes());
        raw.extend_from_slice(&(v.layout.byte_offset() as u64).to_le_bytes());
    }
    for h in group.handles {
        share::send_handle(&s, h).unwrap();
    }
    (&s).write_all(&raw).unwrap();
    wait_ack(&s);
    assert!(child_.wait().unwrap().success());
    for (i, t) in arrays.iter().enumerate() {
        assert_eq!(
            t.to_vec::<f32>().unwrap(),
            vec![100.0 + i as f32, i as f32, i as f32]
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_many_arrays_are_packed_once_and_a_group_of_views_shares_the_pool_block() {
    let device = gpu();
    let arrays: Vec<Tensor> = (0..1000).map(|i| filled(i as f32, 4, device)).collect();
    let group = share::share_many(&arrays, true).unwrap();
    assert_eq!(
        group.handles.len(),
        1,
        "one VMM block for 1000 copied arrays"
    );
    assert_eq!(group.handles[0].kind(), SharedKind::CudaVmm);
    let opened = share::open_many(group).unwrap();
    for (i, t) in opened.iter().enumerate().step_by(97) {
        assert_eq!(on_host(t), vec![i as f32; 4]);
    }
    // Views of one shareable block: one handle, the same memory (a write is seen).
    let block = share::to_shareable(&filled(1.0, 4096, device)).unwrap();
    let views: Vec<Tensor> = (0..64)
        .map(|i| {
            block
                .slice(0, SliceArg::range(i * 64, i * 64 + 64))
                .unwrap()
        })
        .collect();
    let group = share::share_many(&views, false).unwrap();
    assert_eq!(group.handles.len(), 1);
    let opened = share::open_many(group).unwrap();
    // SAFETY: the opened views alias one mapping; nothing reads view 3 during the write.
    unsafe { opened[3].copy_from_unchecked(&filled(5.0, 64, device)) }.unwrap();
    assert_eq!(on_host(&block)[3 * 64..4 * 64], vec![5.0; 64]);
}

// ---------------------------------------------------------------------------------------------
// Against hostile consumers and lenders (Linux: memfd seals, abstract sockets, lent descriptors).

#[cfg(target_os = "linux")]
mod hostile {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Waits at most `secs` seconds for `child` to exit (killing it after that, and failing): a
    /// child that crashes or hangs fails the test instead of taking the test process with it.
    fn exit_within(child: &mut Child, secs: u64) -> std::process::ExitStatus {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if std::time::Instant::now() > until {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child did not finish within {secs} s");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    // ---------------------------------------------------------------------------------------------
    // Hostile consumers and lenders.

    /// Where a handle's bytes carry their ticket: the lender's name starts here, its length byte is
    /// just before, the token (8 bytes) just after.
    fn ticket_at(bytes: &[u8]) -> usize {
        bytes
            .windows(13)
            .position(|w| w == b"dlbridge-fds/")
            .expect("the bytes carry a ticket")
    }

    /// The lender's name and the token of a handle's ticket.
    fn ticket_of(bytes: &[u8]) -> (String, u64) {
        let at = ticket_at(bytes);
        let len = usize::from(bytes[at - 1]);
        let name = String::from_utf8(bytes[at..at + len].to_vec()).unwrap();
        let token = u64::from_le_bytes(bytes[at + len..at + len + 8].try_into().unwrap());
        (name, token)
    }

    /// `bytes` with their ticket's lender renamed `name` and its token made `token`.
    fn with_ticket(bytes: &[u8], name: &str, token: u64) -> Vec<u8> {
        let at = ticket_at(bytes);
        let len = usize::from(bytes[at - 1]);
        let mut out = bytes[..at - 1].to_vec();
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&token.to_le_bytes());
        out.extend_from_slice(&bytes[at + len + 8..]);
        out
    }

    /// A lender's name for process `pid` that no lender has.
    fn lender_name(pid: u32) -> String {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        format!("dlbridge-fds/{pid}/{:08x}{n:08x}", nanos)
    }

    /// An impostor bound to the lender name `name` (in this process): it accepts connections, keeps
    /// them open and never answers, as a stopped producer or a squatter of a dead producer's name.
    fn silent_lender(name: &str) {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming().flatten() {
                held.push(conn);
            }
        });
    }

    /// A handle's bytes lent by this process, of a fresh shareable array of three `f32`.
    fn lent_bytes(value: f32) -> (Tensor, Vec<u8>) {
        let t = share::to_shareable(&Tensor::from_slice(&[value; 3], &[3]).unwrap()).unwrap();
        let bytes = share::share(&t, false).unwrap().to_bytes_lent().unwrap();
        (t, bytes)
    }

    fn open_bytes(bytes: &[u8]) -> dlbridge::Result<Tensor> {
        share::open(SharedHandle::from_bytes(bytes, None)?)
    }

    fn is_value_error(e: &Error, words: &str) -> bool {
        matches!(e, Error::InvalidArgument(m) if m.contains(words))
    }

    /// A consumer holds a descriptor of the producer's file: were the file not sealed, its
    /// `ftruncate` would kill the producer (and every other consumer) with `SIGBUS` at the next read
    /// of the pages cut off. The producer runs in a child, so that a crash fails the test.
    #[test]
    fn a_consumer_cannot_truncate_the_shared_file() {
        if let Some((role, s)) = child() {
            match role.as_str() {
                "seal-producer" => {
                    let t = share::to_shareable(&filled(3.0, 1 << 18, Device::CPU)).unwrap();
                    let (mut truncator, c) = spawn(
                        "hostile::a_consumer_cannot_truncate_the_shared_file",
                        "seal-truncator",
                    );
                    share::send_handle(&c, share::share(&t, false).unwrap()).unwrap();
                    wait_ack(&c);
                    // Every page, after the consumer's attempt.
                    assert!(t.to_vec::<f32>().unwrap().iter().all(|&v| v == 3.0));
                    ack(&c);
                    assert!(exit_within(&mut truncator, 60).success());
                    ack(&s);
                }
                "seal-truncator" => {
                    let h = share::recv_handle(&s).unwrap();
                    let fd = h.fd().unwrap().as_raw_fd();
                    // SAFETY: plain calls on a descriptor the handle owns.
                    let truncated = unsafe { libc::ftruncate(fd, 0) };
                    let errno = std::io::Error::last_os_error().raw_os_error();
                    // SAFETY: as above; a sealed seal refuses more seals.
                    let sealed = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
                    ack(&s);
                    wait_ack(&s);
                    assert_eq!((truncated, errno), (-1, Some(libc::EPERM)));
                    assert_eq!(sealed, -1, "the seals are sealed");
                    let opened = share::open(h).unwrap();
                    assert_eq!(opened.to_vec::<f32>().unwrap()[(1 << 18) - 1], 3.0);
                }
                _ => {}
            }
            return;
        }
        let (mut producer, s) = spawn(
            "hostile::a_consumer_cannot_truncate_the_shared_file",
            "seal-producer",
        );
        let status = exit_within(&mut producer, 120);
        assert!(status.success(), "the producer ended with {status}");
        wait_ack(&s);
    }

    /// A file whose size any holder could change is refused before it is mapped; a block reused
    /// after an export gets a sealed file too.
    #[test]
    fn a_descriptor_without_seals_is_refused() {
        let t = share::to_shareable(&Tensor::from_slice(&[1u8; 64], &[64]).unwrap()).unwrap();
        let mut h = share::share(&t, false).unwrap();
        let bytes = h.to_bytes();
        let fd = h.take_fd().unwrap();
        let inode = |fd: std::os::fd::RawFd| {
            // SAFETY: an all-zero `stat` is a valid value; `fd` is open.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is a valid out-pointer.
            assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
            st.st_ino
        };
        // SAFETY: plain calls; the new descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"dlbridge-shared".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: just opened, owned by nobody else.
        let unsealed = unsafe { share::adopt_fd(raw) }.unwrap();
        // SAFETY: a plain call on an open memfd.
        assert_eq!(unsafe { libc::ftruncate(raw, 4096) }, 0);
        let (real, fake) = (
            inode(fd.as_raw_fd()).to_le_bytes(),
            inode(raw).to_le_bytes(),
        );
        let at = bytes.windows(8).position(|w| w == real).unwrap();
        let mut forged = bytes.clone();
        forged[at..at + 8].copy_from_slice(&fake);
        let err =
            share::open(SharedHandle::from_bytes(&forged, Some(unsealed)).unwrap()).unwrap_err();
        assert!(is_value_error(&err, "not sealed"), "{err}");

        // The block is reused after its export: the fresh file is sealed as well.
        let addr = t.buffer().handle();
        drop((t, fd, bytes));
        let again = share::allocate(Device::CPU, 64, true).unwrap();
        if again.handle() == addr {
            let again = Tensor::new(
                again,
                DType::U8,
                dlbridge::Layout::contiguous(&[64]).unwrap(),
            );
            let h = share::share(&again.unwrap(), false).unwrap();
            let fd = h.fd().unwrap().as_raw_fd();
            // SAFETY: a plain call on a descriptor the handle owns.
            let truncated = unsafe { libc::ftruncate(fd, 0) };
            assert_eq!(truncated, -1, "a reused block's fresh file is sealed too");
        }
    }

    /// Only a ticket's own bytes open it, once: a zeroed token, a token of another ticket (which
    /// stays good for its own handle), and the same bytes a second time (in the same process or
    /// another) are refused. The consumer is a second process.
    #[test]
    fn handle_bytes_open_once_and_only_with_their_token() {
        if let Some((role, s)) = child() {
            if role != "token-consumer" {
                return;
            }
            let real = recv_bytes(&s);
            let zeroed = recv_bytes(&s);
            let swapped = recv_bytes(&s);
            let e = open_bytes(&zeroed).unwrap_err();
            assert!(is_value_error(&e, "altered or forged"), "{e}");
            let e = open_bytes(&swapped).unwrap_err();
            assert!(is_value_error(&e, "another handle's"), "{e}");
            let mut t = open_bytes(&real).unwrap();
            t.as_mut_slice::<f32>().unwrap()[0] = 7.0;
            let e = open_bytes(&real).unwrap_err();
            assert!(is_value_error(&e, "already opened"), "{e}");
            ack(&s);
            wait_ack(&s);
            return;
        }
        let _lending = lending();
        let before = share::broker::outstanding();
        let (a, real) = lent_bytes(1.0);
        let (b, other) = lent_bytes(2.0);
        let (name, _) = ticket_of(&real);
        let (_, other_token) = ticket_of(&other);
        let (mut consumer, s) = spawn(
            "hostile::handle_bytes_open_once_and_only_with_their_token",
            "token-consumer",
        );
        send_bytes(&s, &real);
        send_bytes(&s, &with_ticket(&real, &name, 0));
        send_bytes(&s, &with_ticket(&real, &name, other_token));
        wait_ack(&s);
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![7.0, 1.0, 1.0]);
        // The same bytes in a second process: refused too.
        let e = open_bytes(&real).unwrap_err();
        assert!(is_value_error(&e, "already opened"), "{e}");
        // The other ticket, tried with the wrong handle's bytes, is still good for its own.
        let mut opened = open_bytes(&other).unwrap();
        opened.as_mut_slice::<f32>().unwrap()[1] = 5.0;
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![2.0, 5.0, 2.0]);
        ack(&s);
        assert!(exit_within(&mut consumer, 60).success());
        settles_to(before);
    }

    /// A lender that accepts the connection and never answers (a stopped producer, a process that
    /// binds the name of one that exited) ends the claim after the wait's timeout, and the wait's
    /// interrupt ends it sooner. The claimer is a child: were it to hang, the test fails.
    #[test]
    fn a_lender_that_never_answers_times_out_or_is_interrupted() {
        use share::broker::Wait;
        use std::time::{Duration, Instant};
        if let Some((role, s)) = child() {
            if role != "silent-claimer" {
                return;
            }
            let silent = recv_bytes(&s);
            let start = Instant::now();
            let wait = Wait::new(Duration::from_millis(300));
            let e = share::open_with(SharedHandle::from_bytes(&silent, None).unwrap(), &wait)
                .unwrap_err();
            let took = start.elapsed();
            assert!(
                matches!(&e, Error::Driver { message, .. } if message.contains("did not answer within")),
                "{e}"
            );
            assert!(took >= Duration::from_millis(300), "{took:?}");
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let interrupt = || {
                if calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 2 {
                    Ok(())
                } else {
                    Err(Error::InvalidArgument("stop waiting".into()))
                }
            };
            let wait = Wait {
                timeout: Duration::from_secs(600),
                interrupt: Some(&interrupt),
            };
            let e = share::open_with(SharedHandle::from_bytes(&silent, None).unwrap(), &wait)
                .unwrap_err();
            assert!(is_value_error(&e, "stop waiting"), "{e}");
            ack(&s);
            return;
        }
        let _lending = lending();
        let (_t, bytes) = lent_bytes(1.0);
        // The impostor runs in this process, so the name gives this process's id, as a stopped
        // producer's would.
        let name = lender_name(std::process::id());
        silent_lender(&name);
        let (_, token) = ticket_of(&bytes);
        let (mut claimer, s) = spawn(
            "hostile::a_lender_that_never_answers_times_out_or_is_interrupted",
            "silent-claimer",
        );
        send_bytes(&s, &with_ticket(&bytes, &name, token));
        assert!(exit_within(&mut claimer, 30).success());
        wait_ack(&s);
        // The real ticket is still lent: dropping its handle unopened gives it back.
        drop(SharedHandle::from_bytes(&bytes, None).unwrap());
    }

    /// A socket bound to a lender's name by another process than the one the name gives is not the
    /// lender: refused at once, nothing sent. The claimer is a child: were it to hang, the test
    /// fails.
    #[test]
    fn a_lender_of_another_process_is_refused() {
        if let Some((role, s)) = child() {
            if role != "impostor-claimer" {
                return;
            }
            let e = open_bytes(&recv_bytes(&s)).unwrap_err();
            assert!(
                matches!(&e, Error::Driver { message, .. } if message.contains("held by process")),
                "{e}"
            );
            ack(&s);
            return;
        }
        let _lending = lending();
        let (_t, bytes) = lent_bytes(1.0);
        // Bound by this process, under a name that gives process 1.
        let name = lender_name(1);
        silent_lender(&name);
        let (_, token) = ticket_of(&bytes);
        let (mut claimer, s) = spawn(
            "hostile::a_lender_of_another_process_is_refused",
            "impostor-claimer",
        );
        send_bytes(&s, &with_ticket(&bytes, &name, token));
        assert!(exit_within(&mut claimer, 30).success());
        wait_ack(&s);
        drop(SharedHandle::from_bytes(&bytes, None).unwrap());
    }

    /// A lent descriptor that is never claimed goes back after the ticket's lifetime
    /// (`DLBRIDGE_SHARE_TICKET_TTL`), and a claim after that is told why.
    #[test]
    fn unclaimed_tickets_expire_and_a_late_claim_says_so() {
        if let Some((role, s)) = child() {
            if role != "expiring-producer" {
                return;
            }
            let (_t, bytes) = lent_bytes(1.0);
            let (_u, _) = lent_bytes(2.0);
            let (_v, _) = lent_bytes(3.0);
            assert_eq!(share::broker::outstanding(), 3);
            send_bytes(&s, &bytes);
            let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while share::broker::outstanding() > 0 && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            assert_eq!(
                share::broker::outstanding(),
                0,
                "expired tickets are closed"
            );
            ack(&s);
            wait_ack(&s);
            return;
        }
        let (mut producer, s) = spawn_with(
            "hostile::unclaimed_tickets_expire_and_a_late_claim_says_so",
            "expiring-producer",
            &[("DLBRIDGE_SHARE_TICKET_TTL", "0.3")],
        );
        let bytes = recv_bytes(&s);
        wait_ack(&s);
        let e = open_bytes(&bytes).unwrap_err();
        assert!(
            matches!(&e, Error::Driver { message, .. } if message.contains("not opened in time")),
            "{e}"
        );
        ack(&s);
        assert!(exit_within(&mut producer, 60).success());
    }

    // ---------------------------------------------------------------------------------------------
    // CUDA handles against hostile consumers and lenders.

    /// A VMM and a legacy IPC handle sent as bytes open once and only with their token: a zeroed
    /// token is refused, and so are the same bytes again, for VMM memory also where the consumer
    /// maps the allocation already (no descriptor is needed there, but the ticket is still proved).
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_handle_bytes_open_once_and_only_with_their_token() {
        if let Some((role, s)) = child() {
            if role != "cuda-token-consumer" {
                return;
            }
            for value in [1.0f32, 2.0] {
                let real = recv_bytes(&s);
                let zeroed = recv_bytes(&s);
                let e = open_bytes(&zeroed).unwrap_err();
                assert!(is_value_error(&e, "altered or forged"), "{e}");
                let t = open_bytes(&real).unwrap();
                assert_eq!(on_host(&t)[..3], [value; 3]);
                let e = open_bytes(&real).unwrap_err();
                assert!(is_value_error(&e, "already opened"), "{e}");
                drop(t);
            }
            ack(&s);
            return;
        }
        let _lending = lending();
        let before = share::broker::outstanding();
        let device = gpu();
        // A block of the shareable pool (VMM), and ordinary memory shared without a copy (legacy).
        let vmm = share::to_shareable(&filled(1.0, 1024, device)).unwrap();
        let legacy = filled(2.0, 1024, device);
        let (mut consumer, s) = spawn(
            "hostile::cuda_handle_bytes_open_once_and_only_with_their_token",
            "cuda-token-consumer",
        );
        for (t, kind) in [(&vmm, SharedKind::CudaVmm), (&legacy, SharedKind::CudaIpc)] {
            let mut h = share::share(t, false).unwrap();
            assert_eq!(h.kind(), kind);
            let real = h.to_bytes_lent().unwrap();
            let (name, _) = ticket_of(&real);
            send_bytes(&s, &real);
            send_bytes(&s, &with_ticket(&real, &name, 0));
        }
        wait_ack(&s);
        assert!(exit_within(&mut consumer, 120).success());
        settles_to(before);
    }

    /// A CUDA handle's claim from a lender that never answers ends after the wait's timeout; and a
    /// socket of another process under the lender's name is refused. The claimer is a child.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_a_lender_that_never_answers_or_is_not_the_producer_is_refused() {
        use share::broker::Wait;
        use std::time::Duration;
        if let Some((role, s)) = child() {
            if role != "cuda-silent-claimer" {
                return;
            }
            for _ in 0..2 {
                let silent = recv_bytes(&s);
                let impostor = recv_bytes(&s);
                let wait = Wait::new(Duration::from_millis(300));
                let e = share::open_with(SharedHandle::from_bytes(&silent, None).unwrap(), &wait)
                    .unwrap_err();
                assert!(
                    matches!(&e, Error::Driver { message, .. } if message.contains("did not answer within")),
                    "{e}"
                );
                let e = open_bytes(&impostor).unwrap_err();
                assert!(
                    matches!(&e, Error::Driver { message, .. } if message.contains("held by process")),
                    "{e}"
                );
            }
            ack(&s);
            return;
        }
        let _lending = lending();
        let device = gpu();
        let vmm = share::to_shareable(&filled(1.0, 1024, device)).unwrap();
        let legacy = filled(2.0, 1024, device);
        let silent_name = lender_name(std::process::id());
        silent_lender(&silent_name);
        let impostor_name = lender_name(1);
        silent_lender(&impostor_name);
        let (mut claimer, s) = spawn(
            "hostile::cuda_a_lender_that_never_answers_or_is_not_the_producer_is_refused",
            "cuda-silent-claimer",
        );
        let mut lent = Vec::new();
        for t in [&vmm, &legacy] {
            let bytes = share::share(t, false).unwrap().to_bytes_lent().unwrap();
            let (_, token) = ticket_of(&bytes);
            send_bytes(&s, &with_ticket(&bytes, &silent_name, token));
            send_bytes(&s, &with_ticket(&bytes, &impostor_name, token));
            lent.push(bytes);
        }
        assert!(exit_within(&mut claimer, 60).success());
        wait_ack(&s);
        for bytes in lent {
            drop(SharedHandle::from_bytes(&bytes, None).unwrap()); // given back unopened
        }
    }

    /// A consumer that closes a handle's descriptor before opening it (by number, as Python's
    /// `os.close` of `handle.fd` would) gets a clear error, not a crash: VMM and legacy IPC handles
    /// alike. The consumer is a child.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_a_handle_whose_descriptor_was_closed_is_refused() {
        if let Some((role, s)) = child() {
            if role != "cuda-closer" {
                return;
            }
            // The driver first: starting it opens descriptors, which could take the number closed
            // below and make it another file's.
            drop(filled(0.0, 1, gpu()));
            for _ in 0..2 {
                let h = share::recv_handle(&s).unwrap();
                let raw = h.fd().unwrap().as_raw_fd();
                // SAFETY: closes the handle's own descriptor behind its back, on purpose.
                assert_eq!(unsafe { libc::close(raw) }, 0);
                let e = share::open(h).unwrap_err();
                assert!(is_value_error(&e, "closed by someone else"), "{e}");
            }
            ack(&s);
            return;
        }
        let device = gpu();
        let vmm = share::to_shareable(&filled(1.0, 1024, device)).unwrap();
        let legacy = filled(2.0, 1024, device);
        let (mut closer, s) = spawn(
            "hostile::cuda_a_handle_whose_descriptor_was_closed_is_refused",
            "cuda-closer",
        );
        share::send_handle(&s, share::share(&vmm, false).unwrap()).unwrap();
        share::send_handle(&s, share::share(&legacy, false).unwrap()).unwrap();
        wait_ack(&s);
        assert!(exit_within(&mut closer, 60).success());
        // The producer's memory is whole.
        assert_eq!(on_host(&vmm), vec![1.0; 1024]);
        assert_eq!(on_host(&legacy), vec![2.0; 1024]);
    }

    /// A consumer killed with its work on the shared memory still queued: the producer's memory
    /// stays valid and usable, VMM and legacy IPC alike.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_a_consumer_killed_mid_use_leaves_the_producer_whole() {
        if let Some((role, s)) = child() {
            if role != "cuda-dying" {
                return;
            }
            let a = share::open(share::recv_handle(&s).unwrap()).unwrap();
            let b = share::open(share::recv_handle(&s).unwrap()).unwrap();
            // Copies of 64 MiB queued between reads of the shared memory; killed while they run.
            let big = filled(0.0, 16 << 20, a.device());
            let other = filled(0.0, 16 << 20, a.device());
            let head = other.slice(0, SliceArg::range(0, 1024)).unwrap();
            for _ in 0..256 {
                // SAFETY: `other` and its views are this thread's; nothing reads them meanwhile.
                unsafe { other.copy_from_unchecked(&big) }.unwrap();
                // SAFETY: as above.
                unsafe { head.copy_from_unchecked(&a) }.unwrap();
                // SAFETY: as above.
                unsafe { head.copy_from_unchecked(&b) }.unwrap();
            }
            ack(&s);
            std::thread::sleep(std::time::Duration::from_secs(60));
            return;
        }
        let device = gpu();
        let vmm = share::to_shareable(&filled(1.0, 1024, device)).unwrap();
        let legacy = filled(2.0, 1024, device);
        let (mut dying, s) = spawn(
            "hostile::cuda_a_consumer_killed_mid_use_leaves_the_producer_whole",
            "cuda-dying",
        );
        share::send_handle(&s, share::share(&vmm, false).unwrap()).unwrap();
        share::send_handle(&s, share::share(&legacy, false).unwrap()).unwrap();
        wait_ack(&s);
        dying.kill().unwrap();
        dying.wait().unwrap();
        // SAFETY: the only user of the memory left is this thread.
        unsafe { vmm.copy_from_unchecked(&filled(3.0, 1024, device)) }.unwrap();
        assert_eq!(on_host(&vmm), vec![3.0; 1024]);
        assert_eq!(on_host(&legacy), vec![2.0; 1024]);
    }
}

// ---------------------------------------------------------------------------------------------
// share_memory: ordinary memory moved into process-shareable memory, in place where dlbridge owns
// whole pages (Linux: a shared file mapped over the block's own addresses).

#[cfg(target_os = "linux")]
mod in_place {
    use super::*;

    /// The `/proc/self/maps` line of the mapping holding `addr`.
    fn mapping_of(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .find(|line| {
                let range = line.split_whitespace().next().unwrap();
                let (lo, hi) = range.split_once('-').unwrap();
                let lo = usize::from_str_radix(lo, 16).unwrap();
                let hi = usize::from_str_radix(hi, 16).unwrap();
                (lo..hi).contains(&addr)
            })
            .unwrap_or_else(|| panic!("{addr:#x} is not mapped"))
            .to_owned()
    }

    fn in_shared_file(addr: usize) -> bool {
        mapping_of(addr).contains("dlbridge-shared")
    }

    /// 256 KiB of `f32` from the CPU pool: a block of whole pages of its own.
    fn whole_pages() -> Tensor {
        let data: Vec<f32> = (0..1 << 16).map(|i| i as f32).collect();
        Tensor::from_slice(&data, &[1 << 16]).unwrap()
    }

    #[test]
    fn a_block_of_whole_pages_moves_in_place_and_every_view_sees_the_shared_memory() {
        let t = whole_pages();
        let view = t.slice(0, SliceArg::range(10, 20)).unwrap();
        let addr = t.buffer().handle().expose_provenance();
        assert!(!share::is_shared(&t) && !in_shared_file(addr));

        let moved = share::share_memory(&t).unwrap();
        assert!(moved.buffer().same_allocation(t.buffer()));
        assert_eq!(moved.buffer().handle().expose_provenance(), addr);
        assert!(share::is_shared(&t) && share::is_shared(&view) && in_shared_file(addr));
        assert_eq!(view.to_vec::<f32>().unwrap()[0], 10.0); // the bytes moved with it
        // Moving again is nothing; sharing needs no copy now.
        assert!(share::share_memory_in_place(&t).unwrap());
        let mut other = share::open(share::share(&view, false).unwrap()).unwrap();
        assert_ne!(other.buffer().handle().expose_provenance(), addr);
        other.as_mut_slice::<f32>().unwrap()[1] = -1.0;
        assert_eq!(t.to_vec::<f32>().unwrap()[11], -1.0);
        assert_eq!(view.to_vec::<f32>().unwrap()[1], -1.0);
    }

    #[test]
    fn a_moved_block_gets_private_pages_back_before_the_pool_reuses_it() {
        // Alone in a child process: the pool then hands the same block back.
        if let Some((role, s)) = child() {
            if role != "alone" {
                return;
            }
            let t = whole_pages();
            let addr = t.buffer().handle().expose_provenance();
            share::share_memory(&t).unwrap();
            // A consumer's mapping of the file, as another process would hold it.
            let mut other = share::open(share::share(&t, false).unwrap()).unwrap();
            drop(t);
            let mut again = Tensor::zeros(&[1 << 16], DType::F32, Device::CPU).unwrap();
            assert_eq!(again.buffer().handle().expose_provenance(), addr);
            assert!(!share::is_shared(&again) && !in_shared_file(addr));
            again.as_mut_slice::<f32>().unwrap()[0] = 9.0;
            other.as_mut_slice::<f32>().unwrap()[1] = 8.0;
            assert_eq!(other.to_vec::<f32>().unwrap()[..2], [0.0, 8.0]);
            assert_eq!(again.to_vec::<f32>().unwrap()[..2], [9.0, 0.0]);
            ack(&s);
            return;
        }
        let (mut alone, s) = spawn(
            "in_place::a_moved_block_gets_private_pages_back_before_the_pool_reuses_it",
            "alone",
        );
        wait_ack(&s);
        assert!(alone.wait().unwrap().success());
    }

    #[test]
    fn another_process_writes_the_moved_block_at_its_old_address() {
        if let Some((role, s)) = child() {
            if role != "writer" {
                return;
            }
            let mut t = share::open(share::recv_handle(&s).unwrap()).unwrap();
            assert_eq!(t.to_vec::<f32>().unwrap()[5], 5.0);
            t.as_mut_slice::<f32>().unwrap()[0] = 42.0;
            ack(&s);
            return;
        }
        let t = whole_pages();
        let addr = t.buffer().host_ptr().unwrap();
        share::share_memory(&t).unwrap();
        let (mut writer, s) = spawn(
            "in_place::another_process_writes_the_moved_block_at_its_old_address",
            "writer",
        );
        share::send_handle(&s, share::share(&t, false).unwrap()).unwrap();
        wait_ack(&s);
        assert!(writer.wait().unwrap().success());
        // Read through the address taken before the move (an export's view of it).
        // SAFETY: `t` keeps the block, 256 KiB of f32 from `addr`, alive.
        assert_eq!(unsafe { addr.cast::<f32>().read() }, 42.0);
    }

    #[test]
    fn what_cannot_move_in_place_is_copied() {
        // A small block shares its pages with other allocations.
        let small = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
        assert!(!share::share_memory_in_place(&small).unwrap());
        let copy = share::share_memory(&small).unwrap();
        assert!(!copy.buffer().same_allocation(small.buffer()));
        assert!(share::is_shared(&copy) && !share::is_shared(&small));
        assert_eq!(copy.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        // Memory of a foreign producer is never remapped, however large.
        let values = vec![1.5f32; 1 << 16];
        let (foreign, _probe) = common::Spec::f32(&values, &[1 << 16]).import().tensor();
        assert!(foreign.buffer().is_foreign());
        let copy = share::share_memory(&foreign).unwrap();
        assert!(!copy.buffer().same_allocation(foreign.buffer()) && share::is_shared(&copy));
        assert!(!share::is_shared(&foreign));
        // A strided view of a small block: a compact copy of its elements, read-only kept.
        let base = Tensor::from_slice(&(0..12).collect::<Vec<i32>>(), &[3, 4]).unwrap();
        let view = base
            .slice(
                1,
                SliceArg {
                    start: None,
                    stop: None,
                    step: 2,
                },
            )
            .unwrap()
            .into_read_only();
        let copy = share::share_memory(&view).unwrap();
        assert!(copy.is_read_only() && copy.is_contiguous());
        assert_eq!(copy.to_vec::<i32>().unwrap(), view.to_vec::<i32>().unwrap());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_ordinary_memory_is_shared_as_it_is_and_opens_in_its_own_process() {
    let t = filled(2.0, 1024, gpu());
    let view = t.slice(0, SliceArg::range(16, 32)).unwrap();
    // PyTorch's rule: CUDA memory is shareable without a copy (a legacy IPC handle).
    assert!(share::is_shared(&t) && share::is_shared(&view));
    let moved = share::share_memory(&view).unwrap();
    assert!(moved.buffer().same_allocation(t.buffer()));
    let h = share::share(&view, false).unwrap();
    assert_eq!(h.kind(), SharedKind::CudaIpc);
    // The process that made a legacy handle opens it as the memory it was made of.
    let opened = share::open(h).unwrap();
    assert!(opened.buffer().same_allocation(t.buffer()));
    assert_eq!(opened.byte_offset(), view.byte_offset());
    assert_eq!(opened.shape(), view.shape());
    assert_eq!(on_host(&opened), vec![2.0; 16]);
    // Once only: the same handle's bytes again are refused.
    let mut h = share::share(&view, false).unwrap();
    let bytes = h.to_bytes_lent().unwrap();
    drop(h);
    let again = SharedHandle::from_bytes(&bytes, None).unwrap();
    share::open(again).unwrap();
    assert!(share::open(SharedHandle::from_bytes(&bytes, None).unwrap()).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_pinned_memory_outside_the_shareable_pool_is_copied_into_it() {
    let device = Device::cuda_host(gpu().index());
    let t = Tensor::from_slice(&[1u32, 2, 3], &[3])
        .unwrap()
        .copy_to(device)
        .unwrap();
    assert!(!share::is_shared(&t));
    assert!(!share::share_memory_in_place(&t).unwrap());
    let copy = share::share_memory(&t).unwrap();
    assert!(!copy.buffer().same_allocation(t.buffer()));
    assert!(share::is_shared(&copy) && copy.device() == device);
    assert_eq!(
        share::share(&copy, false).unwrap().kind(),
        SharedKind::HostFile
    );
    // The shareable pool's device memory is shared already.
    let vmm = share::to_shareable(&filled(1.0, 8, gpu())).unwrap();
    assert!(share::is_shared(&vmm));
}
