import { ServerMessage, ClientMessage, TxStatus } from '../wire/codes'

/**
 * Whether a relayed session left its backend idle, for the pool: every Query, Sync and
 * FunctionCall the client sent has had its ReadyForQuery, and no extended-protocol message waits
 * for a Sync. Both directions are walked message by message (headers only, nothing copied). The
 * client's Terminate is taken out: a pooled backend outlives its session.
 *
 * One thing DISCARD ALL cannot undo: a custom setting (`SET app.user_id`, `set_config('app.x', …)`)
 * leaves a placeholder that later reads as '' where a fresh backend has none (NULL), and Postgres
 * lists placeholders nowhere. A backend whose session sent such a statement is not reused.
 */
const TYPES_AWAITING_SYNC = new Set<number>([ClientMessage.Parse, ClientMessage.Bind, ClientMessage.Describe, ClientMessage.Execute, ClientMessage.Close, ClientMessage.Flush])
const ANSWERED = new Set<number>([ClientMessage.Query, ClientMessage.Sync, ClientMessage.FunctionCall])
const { Terminate: TERMINATE, Query: QUERY, Parse: PARSE } = ClientMessage
const READY_FOR_QUERY = ServerMessage.ReadyForQuery
/** A statement's last word before ReadyForQuery. */
const STATEMENT_ENDS = new Set<number>([ServerMessage.CommandComplete, ServerMessage.ErrorResponse, ServerMessage.EmptyQueryResponse])
/**
 * set_config() of anything but a plain literal name without a dot, or SET [SESSION | LOCAL] of a
 * dotted (custom) name, anywhere in a statement's text.
 */
const CUSTOM_SETTING = /set_config(?!\s*\(\s*'[^'.]*'\s*,)|(^|[;(\s])set\s+((session|local)\s+)?("[^"]*"|[a-z_][\w$]*)\s*\./i

/** Whether a statement may make a custom setting (which no reset takes back: see above). */
export const setsCustomSetting = (text: string) => CUSTOM_SETTING.test(text)

/** Finds message boundaries in a stream of protocol messages, chunk by chunk. */
class Boundaries {
  /** A header cut between chunks, gathered (made when first needed: a watch is made per lend). */
  private header?: Buffer
  /** Header bytes of the next message seen so far. */
  private have = 0
  /** Body bytes of the current message still to come. */
  private left = 0

  /** Calls `each(type, start, body, end)` for each message whose header ends in `chunk` (offsets into it; `end` may lie beyond it). */
  feed(chunk: Buffer, each: (type: number, start: number, body: number, end: number) => void) {
    let at = 0
    while (at < chunk.length) {
      if (this.left > 0) {
        const n = Math.min(this.left, chunk.length - at)
        this.left -= n
        at += n
        continue
      }
      if (this.have === 0 && at + 5 <= chunk.length) {
        // The whole header is here (the common case): read in place.
        this.left = chunk.readInt32BE(at + 1) - 4
        each(chunk[at], at, at + 5, at + 5 + this.left)
        at += 5
        continue
      }
      // A header cut between chunks: gathered byte by byte.
      const header = (this.header ??= Buffer.alloc(5))
      while (this.have < 5 && at < chunk.length) header[this.have++] = chunk[at++]
      if (this.have < 5) return
      this.have = 0
      this.left = header.readInt32BE(1) - 4
      each(header[0], at - 5, at, at + this.left)
    }
  }

  get midMessage() {
    return this.have > 0 || this.left > 0
  }
}

export interface Ending {
  pending: number
  status: number
  reusable: boolean
  /** Nothing to undo (transaction pooling knows): kept as it is, without DISCARD ALL. */
  clean?: boolean
}

export class IdleWatch {
  private readonly client = new Boundaries()
  private readonly backend = new Boundaries()
  /** Queries and Syncs not yet answered with ReadyForQuery. */
  private unanswered = 0
  private awaitingSync = false
  /** The next backend byte is a ReadyForQuery's status. */
  private statusNext = false
  private lastStatus?: number
  /** The type of the backend's last message. */
  last = 0
  terminated = false
  /** ReadyForQuery messages Postgres has sent (a pooled backend's login answer is not among them). */
  readies = 0
  private split = false
  private customSetting = false

  /** Queries and Syncs sent and not yet answered with ReadyForQuery. */
  get pending(): number {
    return this.unanswered
  }

  /** The status of Postgres's last ReadyForQuery (idle before any); undefined while it is on its way. */
  get status(): number | undefined {
    return this.statusNext ? undefined : (this.lastStatus ?? TxStatus.Idle)
  }

  /** Nothing under way in either direction: it may watch another backend's (reset), as a new watch would. */
  get quiet(): boolean {
    return !this.unanswered && !this.awaitingSync && !this.statusNext && !this.client.midMessage && !this.backendMidMessage && !this.terminated
  }

  private get backendMidMessage(): boolean {
    return this.backend.midMessage || !!this.framer?.holding
  }

  reset() {
    this.lastStatus = undefined
    this.last = this.readies = 0
    this.split = this.customSetting = false
  }

  /** The client's bytes to pass on: all of them, but a Terminate. */
  fromClient(chunk: Buffer): Buffer {
    let cut = -1
    this.client.feed(chunk, (type, start, body, end) => {
      // A statement split across chunks cannot be read whole: counted as one that set something.
      if ((type === QUERY || type === PARSE) && !this.customSetting) this.customSetting = end > chunk.length || setsCustomSetting(chunk.toString('latin1', body, end))
      if (ANSWERED.has(type)) {
        this.unanswered++
        this.awaitingSync = false
      } else if (TYPES_AWAITING_SYNC.has(type)) this.awaitingSync = true
      else if (type === TERMINATE && cut < 0) {
        this.terminated = true
        this.split ||= start < 0 // part of it went on already: the backend cannot be reused
        cut = Math.max(0, start)
      }
    })
    return cut < 0 ? chunk : chunk.subarray(0, cut)
  }

  /** A whole client message, framed already (a lend's): as fromClient, without the walk. Never a Terminate. */
  sent(msg: Buffer) {
    const type = msg[0]
    if ((type === QUERY || type === PARSE) && !this.customSetting) this.customSetting = setsCustomSetting(msg.toString('latin1', 5))
    if (ANSWERED.has(type)) {
      this.unanswered++
      this.awaitingSync = false
    } else if (TYPES_AWAITING_SYNC.has(type)) this.awaitingSync = true
  }

  /**
   * Whole messages Postgres sent, framed already and tallied by whoever framed them (a lend's relay):
   * as fromBackend, without the walk (`last`: the last one's type, 0 for none).
   */
  received(readies: number, last: number, status: number) {
    if (!last) return
    this.last = last
    this.unanswered -= readies
    this.readies += readies
    if (readies) this.lastStatus = status
  }

  /** Whoever frames Postgres's messages for this watch (see received): it may hold part of one. */
  framer?: { readonly holding: boolean }

  fromBackend(chunk: Buffer) {
    if (this.statusNext && chunk.length) {
      this.lastStatus = chunk[0]
      this.statusNext = false
    }
    this.backend.feed(chunk, (type, _start, body) => {
      this.last = type
      if (type !== READY_FOR_QUERY) return
      this.unanswered--
      this.readies++
      if (body < chunk.length) this.lastStatus = chunk[body]
      else this.statusNext = true
    })
  }

  /** Everything sent is answered and nothing waits for a Sync: the status Postgres gave last (I, T or E); else undefined (`ending` with nothing pending, made for each statement without an object). */
  get settled(): number | undefined {
    if (this.unanswered || this.awaitingSync || this.client.midMessage || this.statusNext) return undefined
    return this.lastStatus ?? TxStatus.Idle
  }

  /**
   * How the session leaves its backend: undefined while it is busy (a statement running, a message
   * half sent, extended-protocol messages waiting for their Sync); else the ReadyForQuery still to
   * come (`pending`: 1 when the last statement has ended but its ReadyForQuery is on its way, as
   * when pg rejects a query on its ErrorResponse and the client ends at once), the last status
   * seen (I, T or E), and whether a reset can clean up after it.
   */
  get ending(): Ending | undefined {
    if (this.awaitingSync || this.client.midMessage || this.statusNext) return undefined
    if (this.unanswered > 1 || (this.unanswered === 1 && (this.backendMidMessage || !STATEMENT_ENDS.has(this.last)))) return undefined
    return { pending: this.unanswered, status: this.lastStatus ?? TxStatus.Idle, reusable: !this.split && !this.customSetting }
  }
}
