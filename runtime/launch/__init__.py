"""Starting ranks and watching them: torchrun's environment or N local gloo processes, the pool of
ranks the tests reuse, fault reports (ranks), what a process is doing now (activity), and progress
of long work on stderr (progress).

May import: nothing of the runtime."""
