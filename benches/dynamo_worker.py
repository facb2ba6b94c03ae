#!/usr/bin/env python3
"""A Dynamo worker in front of one kvroute-fleet mock engine, so that NVIDIA Dynamo's KV
router (which routes only to workers registered in Dynamo's own discovery) can route to
the fleet. Run with the Dynamo virtualenv's python (benches/dynamo.py starts it).

It registers the model for token input (Dynamo's frontend tokenizes), serves `generate`
by sending the request's token ids to the engine's /v1/completions and streaming the
generated ids back, and relays the engine's vLLM ZMQ KV events to Dynamo's router — the
same events kvroute's sidecar reads from the same PUB socket.

    python benches/dynamo_worker.py --engine 127.0.0.1:8101 --events tcp://127.0.0.1:5557 \
        --model-dir target/peers/dynamo-model --id-file worker.id

The environment chooses Dynamo's discovery (DYN_FILE_KV) and hosts; benches/dynamo.py
sets them.
"""
import argparse
import asyncio
import json
import signal

import aiohttp
import uvloop
from dynamo.llm import (KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType,
                        register_model)
from dynamo.runtime import DistributedRuntime

# The endpoint Dynamo's own engine workers (vLLM's, the mocker) serve by default.
ENDPOINT = "dynamo.backend.generate"


class Handler:
    """`generate`: a Dynamo PreprocessedRequest in, LLMEngineOutput dicts out."""

    def __init__(self, engine, model, session, first_token_source):
        self.url = f"http://{engine}/v1/completions"
        self.model = model
        self.session = session
        self.first_token_source = first_token_source

    async def generate(self, request, context):
        if self.first_token_source is not None:
            # As Dynamo's vLLM worker does: the router learns when the prefill ends.
            self.first_token_source.bind(context, (request.get("routing") or {}).get("dp_rank"))
        stop = request.get("stop_conditions") or {}
        body = {"model": self.model, "prompt": request["token_ids"], "stream": True, "return_token_ids": True}
        # Absent, the engine's own default applies, as with any client that sends none.
        if stop.get("max_tokens") is not None:
            body["max_tokens"] = stop["max_tokens"]
        if stop.get("ignore_eos") is not None:
            body["ignore_eos"] = stop["ignore_eos"]
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                yield {"token_ids": [], "finish_reason": f"error: engine {resp.status}: {await resp.text()}"}
                return
            async for line in resp.content:
                if context.is_stopped():
                    return  # leaving closes the stream, and the engine aborts the request
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("object") == "error":
                    yield {"token_ids": [], "finish_reason": f"error: {chunk.get('message')}"}
                    return
                choice = chunk["choices"][0]
                out = {"token_ids": choice.get("token_ids") or []}
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
                    # The engine's prompt and cached-token counts, which the frontend reports
                    # as the response's usage.
                    out["completion_usage"] = chunk["usage"]
                yield out


async def engine_max_model_len(session, engine, model):
    async with session.get(f"http://{engine}/v1/models") as r:
        models = (await r.json())["data"]
    return next(m["max_model_len"] for m in models if m["id"] == model)


async def main(args):
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    loop.add_signal_handler(signal.SIGTERM, runtime.shutdown)
    loop.add_signal_handler(signal.SIGINT, runtime.shutdown)
    endpoint = runtime.endpoint(ENDPOINT)
    # One connection per in-flight request, as the engine (HTTP/1.1, no pipelining) needs.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        max_model_len = await engine_max_model_len(session, args.engine, args.model_name)
        # Relay mode: subscribes to the engine's PUB socket; the worker id is the endpoint's.
        # The local indexer (a mirror the router can query after missed events) is on,
        # as in Dynamo's own workers by default. Dropping the publisher stops the relay,
        # so it is held until the worker stops.
        publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=args.block_size, zmq_endpoint=args.events,
                                     zmq_topic="", enable_local_indexer=True)
        config = ModelRuntimeConfig()
        config.context_length = max_model_len
        # The fleet's engines size their cache as blocks × block size = max_model_len.
        config.total_kv_blocks = max_model_len // args.block_size
        config.max_num_batched_tokens = args.max_num_batched_tokens
        config.kv_event_publishing_enabled = True
        config.enable_local_indexer = True
        await register_model(ModelInput.Tokens, ModelType.Completions | ModelType.Chat, endpoint, args.model_dir,
                             args.model_name, worker_type=WorkerType.Aggregated,
                             kv_cache_block_size=args.block_size, runtime_config=config)
        # Dynamo picks the worker id (random per process); the router reports it as
        # router_worker_id, so this file maps it to the engine.
        with open(args.id_file, "w") as f:
            f.write(f"{endpoint.connection_id()}\n")
        handler = Handler(args.engine, args.model_name, session,
                          await endpoint.first_token_source(WorkerType.Aggregated))
        await endpoint.serve_endpoint(handler.generate, graceful_shutdown=False)
        del publisher


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="the mock engine's host:port")
    ap.add_argument("--events", required=True, help="the engine's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--model-dir", required=True, help="tokenizer files and a config.json (dynamo.py model_dir())")
    ap.add_argument("--model-name", default="mock-llm")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's (its default: 8192)")
    ap.add_argument("--id-file", required=True, help="where to write this worker's Dynamo worker id")
    uvloop.run(main(ap.parse_args()))
