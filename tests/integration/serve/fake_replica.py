"""A stand-in for a vLLM replica behind the gateway, and the gateway as a process of its own in front of
it (``python -m tests.integration.serve.fake_replica PORT_FILE REPLICA_PORT ...``): what the gateway
tests and ``benchmarks/llm_gateway_soak.py`` run against.

The replica is a real HTTP/1.1 server on 127.0.0.1 (it answers like vLLM: server-sent events in
chunked framing, JSON with a Content-Length), and the prompt says how it answers, so that its failures
can be chosen.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

# The key the gateway of these tests accepts from callers.
KEY = "gyk_gateway-relay-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA_KEY = "gyv_replica-key"


def event(i: int, pad: int = 0) -> bytes:
    """One server-sent event as vLLM streams a completion's token."""
    ev = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": f" t{i}" + "x" * pad}],
    }
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeReplica:
    """A replica on a loopback port: the prompt says how it answers (``stream``, ``die``, ``hold``,
    ``flood``, ``badhead``, ``json``, ``refuse``); it records the key it was sent and its connections."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.key = REPLICA_KEY
        self.connections = 0
        self.open = 0
        self.keys: list[str] = []
        self.keep_keys = True
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, backlog=1024)
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                hdr = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                if "content-length" not in hdr:  # a GET (the gateway's /metrics scrape): nothing here
                    w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                if self.keep_keys:
                    self.keys.append(hdr.get("authorization", ""))
                body = json.loads(await r.readexactly(int(hdr["content-length"])))
                how = body["prompt"]
                if how == "json" or how == "refuse":
                    data = json.dumps({"choices": [{"text": "whole"}]} if how == "json" else {"error": "no"})
                    status = b"200 OK" if how == "json" else b"400 Bad Request"
                    w.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                            % (status, len(data), data.encode()))  # fmt: skip
                    continue
                if how == "badhead":
                    w.write(b"SPDY/9 nonsense\r\n\r\n")
                    await w.drain()
                    return
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                        b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                if how == "stream":
                    # Several events in one write and one event split over two: the relay's framing.
                    w.write(chunk(event(0)) + chunk(event(1)))
                    split = chunk(event(2))
                    w.write(split[:7])
                    await w.drain()
                    w.write(split[7:] + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                    await w.drain()
                    continue
                if how == "die":
                    w.write(chunk(event(0)))
                    await w.drain()
                    return
                if how == "hold":
                    w.write(chunk(event(0)))
                    await w.drain()
                    await r.read()  # until the gateway closes the connection
                    return
                if how == "flood":
                    for i in range(100_000):  # until the gateway stops reading or closes
                        w.write(chunk(event(i, pad=2000)))
                        await w.drain()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            w.close()


def gateway_main(port_file: str, replica_port: int, header_timeout_s: float, write_stall_s: float) -> None:
    """The gateway in front of the replica on ``replica_port``, served as ``gpuyard serve --engine vllm``
    serves it (:func:`gpuyard.serve.llm.gateway.serve_gateway`) on a free loopback port, which it writes
    to ``port_file`` once it listens."""
    import os

    from gpuyard.serve.access import Access, key_hash
    from gpuyard.serve.listen import bind
    from gpuyard.serve.llm.gateway import Gateway, GatewayLimits, serve_gateway
    from gpuyard.serve.llm.vllm_engine import Replica, VllmConfig

    rep = Replica(0, replica_port, key=REPLICA_KEY)
    rep.ready = True
    cfg = VllmConfig(folder=Path("/nonexistent"), name="m", context=256)
    gw = Gateway(cfg, [rep], GatewayLimits(max_body_bytes=4096, vocab=1000))
    gw.write_stall_s = write_stall_s
    sock = bind("127.0.0.1", 0)
    tmp = f"{port_file}.tmp"
    Path(tmp).write_text(str(sock.getsockname()[1]))
    os.replace(tmp, port_file)
    serve_gateway(gw, Access(key_hash(KEY), None, False), sock, 5.0, header_timeout_s)


class GatewayProcess:
    """:func:`gateway_main` as a process of its own (its output in ``folder/gateway.log``), ready once
    its ``/health`` answers."""

    def __init__(
        self, replica_port: int, folder: Path, header_timeout_s: float = 10.0, write_stall_s: float = 60.0
    ) -> None:
        import httpx
        from tests.waiting import wait_for

        root = Path(__file__).resolve().parents[3]
        port_file = folder / "gateway.port"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        }
        self.log_path = folder / "gateway.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        cmd = [
            sys.executable,
            "-m",
            "tests.integration.serve.fake_replica",
            str(port_file),
            str(replica_port),
        ]
        self.proc = subprocess.Popen(
            [*cmd, str(header_timeout_s), str(write_stall_s)],
            cwd=root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid

        def listening() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the gateway exited {self.proc.returncode}: {self.log_tail()}")
            return port_file.is_file()

        wait_for(listening, timeout=120)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

        def healthy() -> bool:
            listening()
            try:
                return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=120)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


if __name__ == "__main__":
    gateway_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
