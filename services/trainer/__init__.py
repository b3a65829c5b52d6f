"""The trainer service: FSDP2 PPO-family training from the buffer, weight publication,
checkpoints and resume.

Layout (one job per module):
- `algorithms/`: the pure algorithm core (losses, advantages, π_prox, aggregation).
- `ppo.py`: `PPOTrainer.train_batch(groups)`, one training step, usable in-process.
- `engine.py`, `model.py`: an HF model sharded with `fully_shard`, its optimizer/schedule.
- `plan.py`, `microbatch.py`, `batch.py`, `logprobs.py`, `optim.py`, `stats_agg.py`.
- `loop.py`: claim -> train -> checkpoint -> ack -> version -> publish, on every rank.
- `weight_sync.py`: disk / torch.distributed / gRPC publication to rollout replicas.
- `parity.py`: the probe that each replica computes what the trainer does after an update.
- `checkpoint.py`: torch.distributed.checkpoint + HF export; `metrics.py`: Prometheus.
- `service.py`, `servicer.py`, `control.py`, `client.py`: the gRPC service and its client.
- `launch.py`, `dist.py`, `__main__.py`: `python -m services.trainer` and its N ranks.
"""
