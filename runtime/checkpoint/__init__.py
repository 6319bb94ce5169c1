"""Checkpoints with torch.distributed.checkpoint: a trainer's parameters, optimizer and RNG saved and
loaded under any plan (state), and a rank's part of a full tensor described to DCP (dcp_slices).

May import: runtime.training and below."""
