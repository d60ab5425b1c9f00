import type { WebSocket } from 'ws'
import type { Socket } from 'node:net'

/**
 * What clients can make the proxy hold in memory. A WebSocket message is buffered whole before it
 * is relayed, so a client that declares a large frame and sends it slowly holds that much. Bounded
 * three ways:
 * - before login, a message may be no larger than a first flight needs (FIRST_FLIGHT_BYTES);
 * - after it, no larger than `maxMessageBytes`;
 * - what all clients' unfinished messages (and /sql bodies) hold stays under `limitBytes`. A
 *   message counts for the size its frame headers declare, from the moment they arrive, so one
 *   that does not fit is refused before it is buffered: the newest offender's WebSocket is closed
 *   with 1009, and messages already under way, and other sessions, go on.
 *
 * ws has no per-connection limit, nor a count of what a connection holds: both are its Receiver's
 * fields (ws 8), checked once here so that a ws that changed them fails loudly, not open.
 */
export const FIRST_FLIGHT_BYTES = 64 * 1024
/** How long a WebSocket closed for the budget has to read its close frame before it is cut. */
const SHED_CUT_MS = 100

interface Receiver {
  _maxPayload: number
  /** Bytes received and not yet consumed into a message. */
  _bufferedBytes: number
  /** The size declared so far by the frame headers of the message under way. */
  _totalPayloadLength: number
}

function internals(ws: WebSocket): { receiver: Receiver; socket: Socket } {
  const { _receiver: receiver, _socket: socket } = ws as unknown as { _receiver?: Receiver; _socket?: Socket }
  const fields = ['_maxPayload', '_bufferedBytes', '_totalPayloadLength'] as const
  if (!receiver || fields.some((f) => typeof receiver[f] !== 'number') || !socket) {
    throw new Error(`edgepg-proxy: this version of ws keeps no ${fields.join('/')} on its Receiver; use ws 8`)
  }
  return { receiver, socket }
}

export class BufferBudget {
  /** Bytes held (or declared) by unfinished messages and bodies, all clients together. */
  total = 0

  constructor(readonly limitBytes: number, readonly maxMessageBytes: number) {}

  /**
   * Counts what `ws` holds, with the first-flight limit on its messages until `loggedIn()`
   * lifts it to `maxMessageBytes`. `onShed` is told before it is closed for the budget.
   */
  watch(ws: WebSocket, onShed?: () => void): { loggedIn(): void } {
    const { receiver, socket } = internals(ws)
    receiver._maxPayload = Math.min(FIRST_FLIGHT_BYTES, this.maxMessageBytes)
    let held = 0
    let watching = true
    const update = (now: number) => {
      this.total += now - held
      held = now
    }
    // After ws's own listener: what the receiver holds, or has been told is coming, once it has taken this chunk.
    const onData = () => {
      const before = held
      update(Math.max(receiver._bufferedBytes, receiver._totalPayloadLength))
      if (this.total <= this.limitBytes || held <= before) return
      update(0)
      watching = false
      socket.off('data', onData)
      onShed?.()
      // Its message will never be read: stop reading, say why, and cut it once the close frame is
      // on its way (cut at once, the connection would be reset under it).
      ws.pause()
      ws.close(1009, 'edgepg-proxy: over its memory budget for unfinished messages; try again later')
      setTimeout(() => ws.terminate(), SHED_CUT_MS).unref()
    }
    socket.on('data', onData)
    ws.once('close', () => watching && update(0))
    return { loggedIn: () => void (receiver._maxPayload = this.maxMessageBytes) }
  }

  /** Takes `n` bytes of a /sql body: false (nothing taken) when that would pass the limit. */
  take(n: number): boolean {
    if (this.total + n > this.limitBytes) return false
    this.total += n
    return true
  }

  give(n: number) {
    this.total -= n
  }
}
