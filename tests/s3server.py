"""A real S3 HTTP endpoint on localhost (moto's server mode) for the object-store tests.

Not a mock of the client library: the daemon and the client talk HTTP to it
with the same library they use against AWS. The server runs in the test
process; ``stop`` and ``start`` on the same port keep its buckets (moto's
state lives in this process), so a test can take the endpoint away mid-upload
and bring it back.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

from moto.server import ThreadedMotoServer

logging.getLogger("werkzeug").setLevel(logging.WARNING)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 on 127.0.0.1:port, and the AWS environment that points a process at it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.url, "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self):
        """boto3 on this endpoint, for what the tests check behind ckptd's back (multipart uploads)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def new_bucket(self, prefix: str = "ckpt") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name
