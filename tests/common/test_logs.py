"""Logs are one JSON object per line and carry the service name and extra fields."""

from __future__ import annotations

import json
import logging

from services.common.logs import setup_logging


def test_json_lines_carry_service_and_extras(capsys):
    log = setup_logging("buffer", "DEBUG")
    log.info("stored group", extra={"group_id": "g7", "version": 3})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = [json.loads(x) for x in capsys.readouterr().err.strip().splitlines()]
    assert lines[0]["service"] == "buffer" and lines[0]["msg"] == "stored group"
    assert (lines[0]["group_id"], lines[0]["version"], lines[0]["level"]) == ("g7", 3, "INFO")
    assert "RuntimeError: boom" in lines[1]["exc"]
    logging.getLogger().handlers.clear()
