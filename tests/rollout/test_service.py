"""The rollout replica's readiness (services/rollout/service.py): Ready only while it serves
and is not stuck more than eta behind the buffer with nothing newer to load."""

from __future__ import annotations

from types import SimpleNamespace

from services.rollout.service import RolloutService
from tests.vision_fixtures import tiny_vlm_dir  # noqa: F401  (session-wide tiny Qwen2-VL)


def test_a_replica_behind_is_not_ready_until_it_catches_up() -> None:
    # The readiness bookkeeping alone: a stand-in for the gRPC server records what the
    # health service would answer (SERVING = True).
    health: list[bool] = []
    svc = RolloutService.__new__(RolloutService)
    svc.server = SimpleNamespace(set_serving=health.append)
    svc._serving = svc._behind = svc._ready = False
    svc._set_serving(True)
    assert svc.ready() and health == [True]
    svc._on_behind(True)  # the loop found it too stale and nothing newer published
    assert not svc.ready() and health[-1] is False
    # a weight update while behind (NOT_SERVING during it, then "serving" again) that left
    # it behind keeps it not ready
    svc._set_serving(False)
    svc._set_serving(True)
    assert not svc.ready() and health[-1] is False
    svc._on_behind(False)  # within eta again
    assert svc.ready() and health[-1] is True
    # while applying weights, catching up does not make it ready early
    svc._set_serving(False)
    svc._on_behind(False)
    assert not svc.ready() and health[-1] is False


def test_the_weights_root_is_where_the_trainer_publishes(tmp_path) -> None:  # noqa: ANN001
    # The trainer publishes under its RunPaths.weight_dir (services/trainer/paths.py):
    # trainer.weight_dir, else <fileroot>/<experiment>/<trial>/weights. A replica loads disk
    # updates from that directory only, so both must name the same one.
    from services.common.config import load_config
    from services.rollout.service import weights_root
    from services.trainer.paths import RunPaths

    base = [f"cluster.fileroot={tmp_path}", "experiment_name=e", "trial_name=t"]
    for extra in ([], [f"trainer.weight_dir={tmp_path / 'shared' / 'w'}"]):
        cfg = load_config(None, [*base, *extra])
        assert weights_root(cfg) == RunPaths.from_config(cfg).weight_dir
    assert weights_root(load_config(None, base)) == tmp_path / "e" / "t" / "weights"


async def test_a_vision_replica_renders_with_its_models_processor_and_image_rows(
    tiny_vlm_dir,  # noqa: ANN001, F811
    tmp_path,  # noqa: ANN001
) -> None:
    from services.common.config import load_config
    from services.common.vision_inputs import load_vision_processor
    from services.rollout.data.counting import write_split
    from services.rollout.data.vision import VisionPromptDataset
    from services.rollout.workflows.vision_rlvr import VisionRLVRWorkflow
    from tests.vision_fixtures import IMAGE_SIZE

    data = write_split(tmp_path, "train", 2, seed=0, size=IMAGE_SIZE)
    cfg = load_config(
        None,
        [
            f"actor.path={tiny_vlm_dir}",
            "rollout.workflow=vision_rlvr",
            f"train_dataset.path={data}",
            f"cluster.fileroot={tmp_path}",
        ],
    )
    replica = RolloutService(cfg)
    loop = replica._build_loop()  # the engine is not started: nothing is generated here
    try:
        assert isinstance(loop.workflow, VisionRLVRWorkflow)
        assert loop.workflow.processor is load_vision_processor(tiny_vlm_dir)  # the model's
        assert isinstance(loop.dataset, VisionPromptDataset)
        pngs = {(tmp_path / "train_images" / f"{i:06d}.png").read_bytes() for i in range(2)}
        assert {r.extra["images"][0] for r in loop.dataset.rows} == pngs
    finally:
        for client in replica._clients:
            await client.close()
