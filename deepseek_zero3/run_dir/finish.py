"""A finished run's last work (train.py's train(), after the last step's checkpoint): the model exported as a Hugging
Face directory (final/, and final_ema/ with --ema_decay), its model card (card.py), the loss curve, the checkpoints'
leftovers removed, and --push_to_hub's upload.
"""

from __future__ import annotations

from pathlib import Path

from deepseek_zero3.run_dir import card, checkpoint, metrics


def export_run(run, training) -> int:
    """Export the finished run's model (after the last step's checkpoint): OUT/final, and OUT/final_ema with
    --ema_decay, as Hugging Face directories. Then final/'s model card, the loss curve, and what the finished run no
    longer needs removed; --push_to_hub uploads final/ (run, training: train.py's RunSettings and TrainingObjects).
    Returns the exit code (3: the upload failed, the model is on disk)."""
    accelerator, out = training.accelerator, Path(run.cfg.output_dir)
    again = run.resume is not None and run.resume.state["step"] >= run.total_steps  # a finished run launched again
    kept = card.kept_card(out / "final") if again and accelerator.is_main_process else None
    final = checkpoint.export_final(accelerator, training.model, run.tokenizer, out)
    if training.ema is not None:  # --ema_decay: the moving average as a model of its own, beside final/
        averaged = training.ema.whole(accelerator.is_main_process)
        ema_dir = checkpoint.export_final(accelerator, training.model, run.tokenizer, out, "final_ema", averaged)
        if accelerator.is_main_process:
            card.ema_card(ema_dir, training.ema)
        accelerator.print(f"the weights' moving average (--ema_decay {training.ema.decay:g}, {training.ema.updates} "
                          f"updates) in {ema_dir}: python eval.py --model {ema_dir} scores it")  # fmt: skip
    if training.finalises_checkpoints:
        removed = checkpoint.remove_leftovers(out / "checkpoints")
        if removed:
            print(f"removed from {out / 'checkpoints'}, no longer needed by the finished run: {', '.join(removed)}")
        if aside := checkpoint.set_aside(out / "checkpoints"):
            print(f"kept in {out / 'checkpoints'}: {', '.join(p.name for p in aside)}, the checkpoints explicit "
                  f"--resume commands set aside; delete them once you no longer need them")  # fmt: skip
    if accelerator.is_main_process:
        metrics.plot_losses(out / "metrics.jsonl", out / "loss_curve.png")
        records = metrics.read_metrics(out / "metrics.jsonl")[0]
        card.save(final, kept) if kept is not None else card.write_card(final, run, records)
        accelerator.print(
            f"done: model and its card (README.md) in {final}, loss curve in {out / 'loss_curve.png'}, metrics in "
            f"{out / 'metrics.jsonl'}"
        )
    pushed = ""
    if accelerator.is_main_process and run.cfg.push_to_hub:
        pushed = card.push_final(final, run.cfg.push_to_hub, run.total_steps)
    training.trackers.end_training()
    return 3 if pushed is None else 0
