"""hold_conns.py SOCK EXPORT N OUT STOP — open up to N connections to EXPORT (NBD_OPT_GO), one at
a time, stopping at the first refused or unanswered one; write one line per attempt to OUT
("accepted", "refused <reply> <message>", "no answer ..."), then hold the accepted ones open
until the file STOP exists (at most 120 s)."""
import sys, os, time, socket
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rawnbd import connect, handshake, Disconnected
sock, export, n, out, stop = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), sys.argv[4], sys.argv[5]
held, lines = [], []
for i in range(n):
    try:
        s = connect(sock, timeout=3.0)
        handshake(s, export)
        held.append(s)
        lines.append("accepted")
    except AssertionError as e:
        lines.append(f"refused {e}")
        break
    except (socket.timeout, Disconnected, OSError) as e:
        lines.append(f"no answer {e!r}")
        break
with open(out + ".tmp", "w") as f:
    f.write("\n".join(lines) + "\n")
os.rename(out + ".tmp", out)
deadline = time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.1)
