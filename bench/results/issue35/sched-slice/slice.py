#!/usr/bin/env python3
# usage: slice.py NS PROGRAM ARGS... : SCHED_OTHER with a custom EEVDF slice, then exec
import ctypes, os, struct, sys
ns = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
attr = struct.pack('IIQiIQQQII', 56, 0, 0, 0, 0, ns, 0, 0, 0, 0)
buf = ctypes.create_string_buffer(attr, 56)
if libc.syscall(314, 0, buf, 0) != 0:
    e = ctypes.get_errno(); sys.exit(f'sched_setattr: {os.strerror(e)}')
os.execv(sys.argv[2], sys.argv[2:])
