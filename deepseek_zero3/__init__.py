"""The library behind the three scripts at the repository root (prepare_data.py, train.py, eval.py), one folder per
concern; a script imports what it needs by name, e.g. `from deepseek_zero3.run_dir import checkpoint`.

    cli.py          the command-line edge: Config parsing, the one-line errors, whole-file writes, the console
    distributed.py  how the processes were launched: the Accelerator, the process group, the launch record
    prepare/        what prepare_data.py uses to make token files: documents, corpora, tokenizer processes, the writer
    training_data/  the token files read for training (train.py, eval.py): their format, the sample order, the batch plan
    model/          the model: config presets and tokenizers, MoE load balancing, the chunked loss
    run_dir/        a run's directory: checkpoints and resume, metrics, what keeps a long run going, a checkpoint as
                    a model to evaluate
    planning/       the planner: its entry points (plan.py), model arithmetic, what a strategy costs, what is measured
    evaluation/     downstream tasks through lm-evaluation-harness
"""
