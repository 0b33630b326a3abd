"""Can this kernel do kernel TLS?  Sets the TLS upper-layer protocol on a
connected TCP socket (what rustls + kTLS would do after the handshake) and
prints the kernel's answer, with the kernel's release and its ULP list."""
import os
import socket

TCP_ULP = 31  # include/uapi/linux/tcp.h
print("kernel:", os.uname().release)
with open("/proc/sys/net/ipv4/tcp_available_ulp") as f:
    print("net.ipv4.tcp_available_ulp:", f.read().strip() or "(none)")
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
client = socket.create_connection(listener.getsockname())
try:
    client.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
    print('setsockopt(TCP_ULP, "tls"): ok')
except OSError as e:
    print('setsockopt(TCP_ULP, "tls"):', e)
