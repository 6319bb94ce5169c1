"""One training iteration on a rank (trainer): micro-batches through the schedule, data-parallel sync,
tied parameters (tied), the batch check (batch), the whole step's token mean (loss_tokens), dropout's
random numbers per rank (rng), the activation memory a schedule keeps alive (activation_memory), and
the loss of a batch forward only through the same plan (evaluate).

May import: runtime.pipeline, runtime.data_parallel, runtime.experts, runtime.context and below."""
