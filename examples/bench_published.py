"""fxpar's GPU cost model against published measured training runs: the same as `fxpar validate`.

    python examples/bench_published.py [--cluster h100-sxm-dgx] [--csv FILE] [--match TEXT]
                                       [--json]

Prices every row of planner/bench/published/*.csv (NeMo AutoModel, Megatron-Bridge and torchtitan
tables of H100 BF16 pre-training, each file naming its source) as the fixed configuration its
columns say, and prints the published and predicted step time and tokens/s per GPU, the error,
the predicted compute / exposed communication / bubble, the median and largest |error|, and, per
model and GPU count with several rows, the measured ranking beside the predicted one. Planning
the large Hugging Face models takes up to a minute each.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["validate", *sys.argv[1:]]))
