"""An HTTP upstream for the filter tests: answers naming itself, records what reached it."""
import http.server
import json
import socket
import threading
import time


class Worker:
    """An upstream 'engine': answers JSON naming itself; records every request's headers.
    Request headers steer it: x-test-delay-ms (answer late), x-test-reset (close the
    connection without answering), x-test-stream-ms: FIRST,REST (headers at once, as an
    engine streams: the first body bytes after FIRST ms, as after a prefill, the end REST
    ms later)."""

    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()
        worker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body are separate writes: with Nagle on, the body waits for
            # Envoy's delayed ACK (~40 ms a response).
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                if n:
                    self.rfile.read(n)
                self.do_GET()

            def do_GET(self):
                with worker.lock:
                    worker.requests.append({k.lower(): v for k, v in self.headers.items()})
                if self.headers.get("x-test-reset"):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.headers.get("x-test-stream-ms"):
                    first, rest = (int(v) / 1000 for v in self.headers["x-test-stream-ms"].split(","))
                    try:
                        self.send_response(200)
                        self.send_header("content-type", "text/event-stream")
                        self.send_header("transfer-encoding", "chunked")
                        self.end_headers()
                        self.wfile.flush()
                        time.sleep(first)
                        for chunk in (b"data: {}\n\n", json.dumps({"worker": worker.id}).encode()):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                            time.sleep(rest)
                            rest = 0
                        self.wfile.write(b"0\r\n\r\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return
                delay = int(self.headers.get("x-test-delay-ms") or 0)
                if delay:
                    time.sleep(delay / 1000)
                body = json.dumps({"worker": worker.id}).encode()
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # Envoy reset the stream (the client aborted): expected in tests

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.id = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
