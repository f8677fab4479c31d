//! NCCL point-to-point transfers (`backend::cuda::nccl`): two ranks in one process, one thread
//! and one GPU each, send and receive arrays of several layouts.
//!
//! `#[ignore = "needs two CUDA devices and NCCL"]`: a machine of two GPUs runs it with
//! `-- --include-ignored` (NCCL found through `DLBRIDGE_NCCL_LIBRARY` or the loader's path).

#![cfg(feature = "cuda")]

use std::time::Duration;

use dlbridge::backend::cuda::nccl::{self, Communicator};
use dlbridge::{DType, Device, SliceArg, Tensor};

/// The arrays sent, made by `on` from host data: a matrix and four views of it (one buffer),
/// bytes, a 0-d array and 500 small arrays of their own.
fn sources(on: impl Fn(Tensor) -> Tensor) -> Vec<Tensor> {
    let matrix: Vec<f32> = (0..64 * 64).map(|i| i as f32).collect();
    let m = on(Tensor::from_slice(&matrix, &[64, 64]).unwrap());
    let bytes: Vec<u8> = (0..=255).collect();
    let mut out = vec![
        m.clone(),
        m.index(1, 3).unwrap(),
        m.slice(
            0,
            SliceArg {
                start: None,
                stop: None,
                step: -2,
            },
        )
        .unwrap(),
        m.transpose().unwrap(),
        m.slice(0, SliceArg::range(4, 4)).unwrap(),
        on(Tensor::from_slice(&bytes, &[256]).unwrap()),
        on(Tensor::from_slice(&[1.5f64], &[]).unwrap()),
    ];
    for i in 0..500 {
        out.push(on(Tensor::from_slice(&[i; 8], &[8]).unwrap()));
    }
    out
}

#[test]
#[ignore = "needs two CUDA devices and NCCL"]
fn arrays_of_several_layouts_arrive_equal_on_the_other_gpu() {
    assert!(
        dlbridge::backend::cuda::device_count().unwrap() >= 2,
        "this test needs two CUDA devices"
    );
    let id = nccl::unique_id().expect("NCCL loads");
    let plan_of_sender = std::sync::Mutex::new(None);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let sender = s.spawn({
            let plan_of_sender = &plan_of_sender;
            let id = &id;
            move || {
                let comm = Communicator::new(id, 2, 0, 0).unwrap();
                let on_gpu = sources(|t| t.copy_to(Device::cuda(0)).unwrap());
                let plan = comm.plan(&on_gpu).unwrap();
                let runs: Vec<(usize, usize)> =
                    plan.runs.iter().map(|r| (r.len, r.phase())).collect();
                tx.send((runs.clone(), plan.views.clone())).unwrap();
                *plan_of_sender.lock().unwrap() = Some(plan);
                comm.send(&on_gpu, 1, Some(&runs), Some(Duration::from_secs(60)))
                    .unwrap();
            }
        });
        let receiver = s.spawn(move || {
            let comm = Communicator::new(&id, 2, 1, 1).unwrap();
            let (runs, views) = rx.recv().unwrap();
            let got = comm
                .recv(&runs, &views, 0, Some(Duration::from_secs(60)))
                .unwrap();
            for (g, e) in got.iter().zip(sources(|t| t)) {
                assert_eq!(g.device(), Device::cuda(1));
                assert_eq!(g.shape(), e.shape());
                let back = g.copy_to(Device::CPU).unwrap();
                match e.dtype() {
                    DType::F32 => {
                        assert_eq!(back.to_vec::<f32>().unwrap(), e.to_vec::<f32>().unwrap())
                    }
                    DType::F64 => {
                        assert_eq!(back.to_vec::<f64>().unwrap(), e.to_vec::<f64>().unwrap())
                    }
                    DType::U8 => {
                        assert_eq!(back.to_vec::<u8>().unwrap(), e.to_vec::<u8>().unwrap())
                    }
                    DType::I32 => {
                        assert_eq!(back.to_vec::<i32>().unwrap(), e.to_vec::<i32>().unwrap())
                    }
                    other => panic!("unexpected {other}"),
                }
            }
            got.len()
        });
        sender.join().unwrap();
        assert_eq!(receiver.join().unwrap(), sources(|t| t).len());
    });
    // The matrix and its views travel as one run (the empty view as none); every other
    // allocation is at most one run of its own.
    let plan = plan_of_sender.into_inner().unwrap().unwrap();
    let matrix: Vec<_> = [0, 1, 2, 3].iter().map(|&k| plan.views[k].run).collect();
    assert!(
        matrix.iter().all(|r| r.is_some() && *r == matrix[0]),
        "{matrix:?}"
    );
    assert_eq!(plan.views[4].run, None);
    assert!(plan.runs.len() <= 1 + 2 + 500, "{} runs", plan.runs.len());
}

#[test]
#[ignore = "needs a CUDA device and NCCL 2.14 or later"]
fn a_rank_that_never_joins_ends_the_join_by_its_timeout() {
    let (major, minor, _) = nccl::version().expect("NCCL loads");
    assert!(
        (major, minor) >= (2, 14),
        "non-blocking joins need NCCL 2.14"
    );
    let id = nccl::unique_id().unwrap();
    let began = std::time::Instant::now();
    let e = Communicator::join(&id, 2, 0, 0, Some(Duration::from_secs(2))).unwrap_err();
    assert!(e.to_string().contains("did not finish within 2.0 s"), "{e}");
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "{:?}",
        began.elapsed()
    );
    // A communicator of one rank joins at once, and sends to nobody.
    let alone = Communicator::join(
        &nccl::unique_id().unwrap(),
        1,
        0,
        0,
        Some(Duration::from_secs(30)),
    )
    .unwrap();
    assert_eq!(alone.size(), 1);
}

#[test]
fn a_rank_outside_the_communicator_is_refused_before_nccl_is_asked() {
    let e = Communicator::new(&[0; nccl::UNIQUE_ID_BYTES], 2, 5, 0).unwrap_err();
    assert!(e.to_string().contains("rank 5"), "{e}");
}
