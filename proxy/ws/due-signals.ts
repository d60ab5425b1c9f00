/**
 * pg_cancel_backend / pg_terminate_backend of a processID the proxy told, as a lent session's
 * statements ask for them (proxy/isolation/reader.ts `signals`): each is sent once Postgres has run the
 * statement and its answer is on its way to the client (Postgres signals while it runs; acting as it
 * passed by would end targets before it ran), to the session told that processID (proxy/ws/signals.ts).
 */
import type { Reading } from '../isolation/reader'
import { ClientMessage } from '../wire/codes'
import type { Signals, SignalKind } from './signals'

/** Signals kept for statements not yet answered: a client may pipeline without end. */
const MAX_DUE = 64

export class DueSignals {
  /** Each with the count of ReadyForQuery the client must have read first. */
  private due: Array<{ after: number; kind: SignalKind; pid: number }> = []

  constructor(private readonly signals: Signals, private readonly role: string) {}

  /** What `msg` (read as `reading`) asks for, due once the client has read `after` ReadyForQuery. */
  add(msg: Buffer, reading: Reading, after: number) {
    if (!reading.signals || msg[0] === ClientMessage.Parse) return
    for (const s of reading.signals) {
      const pid = s.pid ?? (msg[0] === ClientMessage.Bind ? bindParameter(msg, s.param!) : undefined)
      if (pid !== undefined) this.due.push({ after, kind: s.kind, pid })
      if (this.due.length > MAX_DUE) this.send(0, 1) // (pipelined without end: the oldest now)
    }
  }

  /** Those whose statements the client has its answer to (it has read `readies`), and the first `n` besides (the session ended: all). */
  send(readies: number, n = 0) {
    if (!this.due.length) return
    let due = 0
    while (due < this.due.length && (due < n || this.due[due].after <= readies)) due++
    for (const s of this.due.splice(0, due)) this.signals.send(s.kind, s.pid, this.role)
  }

  /** Statements past `readies` will be sent again (elsewhere), and ask again then. */
  forgetAfter(readies: number) {
    this.due = this.due.filter((s) => s.after <= readies)
  }
}

/** A Bind's parameter `n` (1-based) as an integer, text or binary; undefined if it is none. */
function bindParameter(bind: Buffer, n: number): number | undefined {
  let at = bind.indexOf(0, bind.indexOf(0, 5) + 1) + 1
  const formats = bind.readInt16BE(at)
  const format = formats === 0 ? 0 : bind.readInt16BE(at + 2 + 2 * (formats === 1 ? 0 : n - 1))
  at += 2 + 2 * formats
  if (n > bind.readInt16BE(at)) return undefined
  at += 2
  for (let i = 1; i < n; i++) at += 4 + Math.max(0, bind.readInt32BE(at))
  const length = bind.readInt32BE(at)
  const value = bind.subarray(at + 4, at + 4 + Math.max(0, length))
  if (length < 0) return undefined
  if (format === 0) return /^\s*[+-]?\d+\s*$/.test(value.toString('latin1')) ? Number(value.toString('latin1')) : undefined
  return length === 4 ? value.readInt32BE(0) : length === 8 ? Number(value.readBigInt64BE(0)) : undefined
}
