/**
 * Bytes that go to many WebSockets at once (a notification to every listener of its channel):
 * framed once, and written straight to each socket, not framed again by ws for each.
 */
import type { Socket } from 'node:net'
import { WebSocket } from 'ws'

const frames = new WeakMap<Buffer, Buffer>()

/** `data` as one unmasked binary frame, as a server sends it (RFC 6455 §5.2); made once per Buffer. */
export function binaryFrame(data: Buffer): Buffer {
  let frame = frames.get(data)
  if (frame) return frame
  const head = data.length < 126 ? 2 : data.length < 65536 ? 4 : 10
  frame = Buffer.allocUnsafe(head + data.length)
  frame[0] = 0x82 // (FIN, binary)
  if (head === 2) frame[1] = data.length
  else if (head === 4) (frame[1] = 126), frame.writeUInt16BE(data.length, 2)
  else (frame[1] = 127), frame.writeBigUInt64BE(BigInt(data.length), 2)
  data.copy(frame, head)
  frames.set(data, frame)
  return frame
}

interface Internals {
  _socket?: Socket
  /** ws's own queue: frames waiting behind compression or a Blob's read, which a direct write would pass. */
  _sender?: { _queue?: unknown[] }
}

/** `data` to `ws`, in order with what ws sent before it. */
export function sendShared(ws: WebSocket, data: Buffer) {
  const { _socket: socket, _sender: sender } = ws as unknown as Internals
  if (ws.readyState !== WebSocket.OPEN || !socket || sender?._queue?.length !== 0) return ws.send(data)
  socket.write(binaryFrame(data))
}
