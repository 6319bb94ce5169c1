"""Other frameworks' configurations in and out: `--emit torchtitan|megatron` (emit), Megatron-LM flags
and torchtitan TOML read as a Configuration (from_megatron, from_torchtitan, with the checks both
readers share in readers), a Configuration priced with fxpar's cost model (configuration), and
`--from-megatron/--from-torchtitan` priced beside fxpar's own plan (price_imported).

May import: planner.api, planner.report, planner.search, planner.weights, planner.models; the floors below."""
