"""The ckptd wire protocol and on-disk format, shared by daemon and client.

No torch and nothing of the daemon's or the client's (``tests/test_layering.py``
checks): the daemon imports this without torch, and the client imports it
without the daemon. Beside the standard library it uses msgpack (messages),
pyzmq (``request.py``), crc32c (``checksums.py``), and the object-store
client ``obstore``, imported by ``objects.py`` on first use of an ``s3://`` name.
"""

from .errors import *  # noqa: F401,F403
from .index import CheckpointIndex, ShardRecord, latest, read_index
from .layout import DTYPE_SIZES, ShardLayout, TensorEntry, parse_header, plan_layout
from .messages import PROTOCOL_VERSION, Message, decode, encode

__version__ = "0.1.0"
