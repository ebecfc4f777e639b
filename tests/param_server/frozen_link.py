"""A TCP link to a server that can be frozen: it stops passing bytes but keeps both
connections open, as a peer whose machine vanished (no FIN, no RST) looks to the other."""

import select
import socket
import threading


class FreezableLink:
  """Listens on 127.0.0.1:`port`, each connection relayed to 127.0.0.1:`target_port`."""

  def __init__(self, target_port: int):
    self.target = ("127.0.0.1", target_port)
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.port = self._listener.getsockname()[1]
    self.address = f"127.0.0.1:{self.port}"
    self.frozen = threading.Event()
    self._closed = threading.Event()
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        down, _ = self._listener.accept()
        up = socket.create_connection(self.target)
      except OSError:
        return
      threading.Thread(target=self._pump, args=(down, up), daemon=True).start()

  def _pump(self, down: socket.socket, up: socket.socket) -> None:
    while not self._closed.is_set():
      if self.frozen.is_set():
        self._closed.wait(0.05)
        continue
      ready, _, _ = select.select([down, up], [], [], 0.05)
      for s in ready:
        try:
          data = s.recv(1 << 16)
          if data:
            (up if s is down else down).sendall(data)
        except OSError:
          data = b""
        if not data:
          return

  def close(self) -> None:
    self._closed.set()
    self._listener.close()
