"""`fxpar calibrate`: compute and collective microbenchmarks (bench_compute, bench_comm), the least-
squares fits of their timings (fitting), and the profile they make (calibrate).

May import: cost_model.hardware, cost_model.ops; passes, runtime."""
