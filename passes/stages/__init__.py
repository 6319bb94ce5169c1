"""From a rewritten graph to what one rank runs: the split at layer boundaries into stage programs
(pipeline_split) and the programs and trainer of a rank (program).

May import: passes.rewrite, passes.capture; runtime."""
