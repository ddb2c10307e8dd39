"""The gateway's OpenAI API against OpenAI's own published OpenAPI description (bench/openapi_fuzz.py): requests
generated from the spec's request schemas with the episode's key, every answer checked against the spec's response
schemas (2xx bodies, each streamed chunk, tool calls) or its ErrorResponse (4xx); never a 5xx, never a dropped
connection, and the gateway still answers afterwards. `rose bench openapi` runs a larger budget on a real fleet."""

from __future__ import annotations

from rose.bench.openapi_fuzz import OPERATIONS, OpenApiSpec, anchors, fuzz, generate, load_spec
from rose.services.gateway.config import EpisodeSettings, GatewayConfig
from rose.shared.turns.settings import TurnSettings
from rose.testing.gateway import arithmetic_task, start_gateway

MODEL = "rose-policy"
REQUESTS = 200  # generated requests (plus the anchors), all in one episode: ~5 s on the 2-core box
SEED = 67


async def test_generated_requests_get_answers_that_meet_openais_published_schema(gw_bus, fleet, models_dir, tmp_path, capsys):
    config = GatewayConfig(turns=TurnSettings(hedge=False, retry_backoff_s=0.05), episodes=EpisodeSettings(max_turns=REQUESTS + 20), ack_wait_s=10.0)
    gateway = await start_gateway(gw_bus, models_dir, None, tmp_path, config=config)
    try:
        spec = OpenApiSpec(load_spec())
        cases, _ = generate(spec, MODEL, REQUESTS, SEED)
        episode = await gateway.episodes.open(arithmetic_task(44, "api-openapi", max_turns=REQUESTS + 20))
        _, base = gateway.episodes.urls(episode)
        report = await fuzz(spec, base, episode.key, anchors(MODEL) + cases)
        with capsys.disabled():
            print(f"\ngateway vs OpenAI's spec: {report.summary()}")
        assert report.violations == [] and report.dropped == [], report.summary()
        assert not any(status >= 500 for status in report.statuses)
        assert all(report.ok_by_operation[f"{m} {p}"] > 0 for m, p in OPERATIONS), report.summary()
        assert episode.ending is None and any(t.reply.get("tool_calls") for t in episode.turns)  # a tool call was answered, and checked
        still = await fuzz(spec, base, episode.key, anchors(MODEL)[:2])
        assert still.statuses == {200: 2} and still.violations == []
    finally:
        await gateway.close()
