"""The ckptd wire protocol and on-disk format, shared by daemon and client.

msgpack and the standard library only: the daemon imports this without
torch, and the client imports it without the daemon. (``objects.py``
imports the object-store client, ``obstore``, on first use of an ``s3://`` name.)
"""

from .errors import *  # noqa: F401,F403
from .index import CheckpointIndex, ShardRecord, latest, read_index
from .layout import DTYPE_SIZES, ShardLayout, TensorEntry, parse_header, plan_layout
from .messages import PROTOCOL_VERSION, Message, decode, encode

__version__ = "0.1.0"
