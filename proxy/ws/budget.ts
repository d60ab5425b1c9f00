import type { WebSocket } from 'ws'
import type { Socket } from 'node:net'

/**
 * What clients can make the proxy hold in memory. A WebSocket message is buffered whole before it
 * is relayed, so a client that declares a large frame and sends it slowly holds that much. Bounded
 * three ways:
 * - before login, a message may be no larger than a first flight needs (FIRST_FLIGHT_BYTES);
 * - after it, no larger than `maxMessageBytes`;
 * - what all clients' unfinished messages (WebSocket messages, protocol messages cut across them
 *   or waiting for a backend, and /sql bodies) hold stays under `limitBytes`. A message counts for
 *   the size its header declares, from the moment it arrives, so one that does not fit is refused
 *   before it is buffered: the newest offender's WebSocket is closed with 1009, and messages
 *   already under way, and other sessions, go on.
 *
 * ws has no per-connection limit, nor a count of what a connection holds: both are its Receiver's
 * fields (ws 8), checked once here so that a ws that changed them fails loudly, not open.
 */
export const FIRST_FLIGHT_BYTES = 64 * 1024
/** How long a WebSocket closed for the budget has to read its close frame before it is cut. */
const SHED_CUT_MS = 1000

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

export interface SessionMemory {
  loggedIn(): void
  /**
   * The session holds `bytes` of the client's beside what ws holds (a protocol message cut across
   * WebSocket messages, messages waiting for a backend): false if that does not fit, and the
   * WebSocket is being closed for it (or was).
   */
  hold(bytes: number): boolean
}

export class BufferBudget {
  /** Bytes held (or declared) by unfinished messages and bodies, all clients together. */
  total = 0

  constructor(readonly limitBytes: number, readonly maxMessageBytes: number) {}

  /**
   * Counts what `ws` holds, with the first-flight limit on its messages until `loggedIn()`
   * lifts it to `maxMessageBytes`; and what its session holds of the client's beside it, as the
   * session tells `hold()`. `onShed` is told before it is closed for the budget.
   */
  watch(ws: WebSocket, onShed?: () => void): SessionMemory {
    const { receiver, socket } = internals(ws)
    receiver._maxPayload = Math.min(FIRST_FLIGHT_BYTES, this.maxMessageBytes)
    /** What ws holds (or has been told is coming), and what the session holds beside it. */
    let inWs = 0
    let inSession = 0
    let held = 0
    let watching = true
    const update = () => {
      this.total += inWs + inSession - held
      held = inWs + inSession
    }
    /** Whether it is within the budget; if not (and it grew), it is closed. */
    const check = (before: number) => {
      if (this.total <= this.limitBytes || held <= before) return true
      inWs = inSession = 0
      update()
      watching = false
      socket.off('data', onData)
      onShed?.()
      // Its message will never be read: stop reading, say why, and cut it once the close frame is
      // on its way (cut at once, the connection would be reset under it).
      ws.pause()
      ws.close(1009, 'edgepg-proxy: over its memory budget for unfinished messages; try again later')
      setTimeout(() => ws.terminate(), SHED_CUT_MS).unref()
      return false
    }
    // After ws's own listener: what the receiver holds, or has been told is coming, once it has taken this chunk.
    const onData = () => {
      if (!watching) return // (shed by hold() as ws read this very chunk: this listener was already due)
      const before = held
      inWs = Math.max(receiver._bufferedBytes, receiver._totalPayloadLength)
      update()
      check(before)
    }
    socket.on('data', onData)
    ws.once('close', () => watching && ((inWs = inSession = 0), update()))
    return {
      loggedIn: () => void (receiver._maxPayload = this.maxMessageBytes),
      hold: (bytes) => {
        if (!watching) return false
        const before = held
        inWs = Math.max(receiver._bufferedBytes, receiver._totalPayloadLength) // (the message just taken is no longer ws's)
        inSession = bytes
        update()
        return check(before)
      },
    }
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
