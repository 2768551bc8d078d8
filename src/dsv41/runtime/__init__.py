"""The mechanism under the engine: the paged KV pool, the model runner and the forwards over many sequences' rows
(docs/ENGINE.md). `ModelRunner.execute(batch) -> StepOutput` is the one entry point; which forward it calls (the
reference math over pool views on the CPU, the fast path on a GPU) is chosen where the runner is built."""
