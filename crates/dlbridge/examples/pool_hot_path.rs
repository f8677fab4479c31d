//! Times a cached allocate + free through the CPU pool, from Rust (no Python in the way).
//!
//!     cargo run --release -p dlbridge --example pool_hot_path
//!
//! Prints the median over 15 rounds of the mean time per allocate + free, after a warm-up that
//! puts a block of each size in the cache; and, for comparison, the same through `Tensor::empty`.

use std::time::Instant;

use dlbridge::{DType, Device, Tensor, backend::cpu};

fn median_ns(mut f: impl FnMut(), calls: u32) -> f64 {
    f();
    let mut rounds: Vec<f64> = (0..15)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..calls {
                f();
            }
            start.elapsed().as_nanos() as f64 / f64::from(calls)
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[rounds.len() / 2]
}

fn main() -> dlbridge::Result<()> {
    let pool = cpu::pool();
    println!("| size | pool allocate + free (ns) | Tensor::empty + drop (ns) |");
    println!("| --- | ---: | ---: |");
    for (label, bytes) in [
        ("4 KiB", 4 << 10),
        ("1 MiB", 1 << 20),
        ("256 MiB", 256 << 20),
    ] {
        let raw = median_ns(
            || {
                drop(std::hint::black_box(
                    pool.allocate_static(bytes, None, false).unwrap(),
                ))
            },
            100_000,
        );
        let tensor = median_ns(
            || {
                drop(std::hint::black_box(
                    Tensor::empty(&[bytes], DType::U8, Device::CPU).unwrap(),
                ))
            },
            100_000,
        );
        println!("| {label} | {raw:.0} | {tensor:.0} |");
    }
    let stats = pool.stats();
    println!(
        "\ndriver allocations: {}, cache hits: {}",
        stats.driver_allocations, stats.cache_hits
    );
    Ok(())
}
