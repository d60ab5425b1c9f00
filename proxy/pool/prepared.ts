/**
 * Named prepared statements that follow a session from backend to backend (transaction pooling).
 *
 * A session's statements are the Parse messages it sent, by name. Before a message names a
 * statement (Parse, Bind, Describe or Close of a statement), the relay makes the backend hold what
 * the session holds under that name, and nothing where the session holds nothing, with Close and
 * Parse messages of its own whose answers the client never sees. Postgres itself then answers as
 * it would on one connection: 42P05 for a name parsed twice, 26000 for one never parsed, and its
 * own error for a statement that DDL has since broken (the proxy's Parse fails, in the client's
 * message's place). The backend keeps at most `limit` of them, the least recently used closed first.
 *
 * A statement's result type is fixed when the session first prepares it, as Postgres fixes it: the
 * proxy describes every statement it or the session prepares (answers unseen). Where DDL has changed
 * the type since, a Bind fails with Postgres's 0A000 ("cached plan must not change result type"),
 * as on one connection, rather than run on a copy prepared again with the new type.
 */
import { serialize } from 'pg-protocol'
import { EMPTY, Framer } from '../wire/bytes'
import { ClientMessage, DescribeTarget, ServerMessage, TxStatus } from '../wire/codes'
import { cString, errorResponse } from '../wire/startup'
import { plainTag } from '../isolation/reader'
import type { Backend } from './backends'

/** A session's named statements: name → its Parse message. */
export type SessionStatements = Map<string, Buffer>

/** What one backend holds, least recently used first. */
export class BackendStatements {
  readonly held = new Map<string, Buffer>()
  /** Each held statement's result type, once Postgres has described it (see resultType). */
  readonly types = new Map<string, string>()
  /** The statement behind each open portal: closing it would close the portal. */
  readonly portals = new Map<string, string>()
  constructor(readonly limit = 100) {}

  /** The backend was reset (DISCARD ALL): it holds none. */
  clear() {
    // (Clearing a Map makes it a new table, empty or not: most backends hold none.)
    if (this.held.size) this.held.clear()
    if (this.types.size) this.types.clear()
    if (this.portals.size) this.portals.clear()
  }

  use(name: string, parse: Buffer) {
    this.held.delete(name)
    this.held.set(name, parse)
  }

  /** Whether closing `name` would close a portal (save the unnamed one, if `replacing` it). */
  inUse(name: string, replacing: boolean): boolean {
    for (const [portal, statement] of this.portals) if (statement === name && !(replacing && portal === '')) return true
    return false
  }
}

/** The statements each backend holds, by backend, as of its last reset (which drops them all). */
const heldBy = new WeakMap<Backend, { resets: number; statements: BackendStatements }>()

/** What `backend` holds now (at most `limit`): nothing once it has been reset since it was last asked. */
export function statementsOn(backend: Backend, limit: number): BackendStatements {
  let entry = heldBy.get(backend)
  if (!entry) heldBy.set(backend, (entry = { resets: backend.resets, statements: new BackendStatements(limit) }))
  else if (entry.resets !== backend.resets) (entry.resets = backend.resets), entry.statements.clear() // (one per backend: a session's spare relay may still name it, unused)
  return entry.statements
}

/** An answer the relay waits for: ParseComplete, CloseComplete, a ReadyForQuery (`sync`), or a statement's description. */
interface Awaited {
  kind: 'parse' | 'close' | 'sync' | 'describe' | 'handover'
  /** Sent by the proxy: its answer is not the client's. */
  own?: boolean
  /** Sent by the proxy ahead of a simple Query, in a Sync group of its own: an error is not the client's either. */
  ahead?: boolean
  /** The proxy's own messages up to a Sync: every answer up to its ReadyForQuery is the proxy's (each row's first value to `onRow`; `ready` gets the transaction status). */
  swallow?: boolean
  onRow?: (value: string) => void
  ready?: (status: number) => void
  /** Postgres answered it. */
  done?: () => void
  /** A Describe of the proxy's own: the statement's result type, from its RowDescription or NoData. */
  described?: (type: string) => void
  /** An error earlier in its Sync group made Postgres skip it. */
  skipped?: () => void
  /** Answers still to end a lead (see lead). */
  left?: number
  /** For a simple Query: the statements its DEALLOCATEs name, in order. */
  deallocates?: string[]
  /** A lead's: whether Postgres ran it all (see lead). */
  answered?: (ok: boolean) => void
}

/** Messages of the proxy's own, ending in their one ReadyForQuery: see StatementRelay.ownQuery. */
export interface Own {
  query: Buffer
  onRow?: (value: string) => void
  ready?: (status: number) => void
}

const SYNC = serialize.sync()
/** The client's own Parse and Sync, awaited as they are most of the time (never changed: made once). */
const PARSED: Awaited = Object.freeze({ kind: 'parse' })
const SYNCED: Awaited = Object.freeze({ kind: 'sync' })
const FLUSH = serialize.flush()
/** The statement a Bind names instead, when the session's statement no longer has its result type: Postgres's 26000 for it becomes 0A000. */
const TYPE_CHANGED = 'edgepg: result type changed'
const TYPE_CHANGED_ERROR = errorResponse('0A000', 'cached plan must not change result type', 'ERROR')

/** The result type each session statement (its Parse message) had when the session first prepared it. */
const firstTypes = new WeakMap<Buffer, string>()

/** Whether the CommandComplete tag at `at` (to `end`) is `SELECT n`, `INSERT 0 n`, `UPDATE n` or `DELETE n`: plain, undoing nothing, read without a string made of it (most statements' tag). */
function rowsTag(bytes: Buffer, at: number, end: number): boolean {
  if (end - at < 9 || bytes[at + 6] !== 0x20) return false
  const head = bytes.readUInt32BE(at)
  const tail = bytes.readUInt16BE(at + 4)
  return (head === 0x53454c45 && tail === 0x4354) || (head === 0x494e5345 && tail === 0x5254) || (tail === 0x5445 && (head === 0x55504441 || head === 0x44454c45)) // SELE CT, INSE RT, UPDA/DELE TE
}

/** A result type as Postgres compares them for a prepared statement: each column's type and typmod ('' for NoData). */
function resultType(msg: Buffer): string {
  if (msg[0] === ServerMessage.NoData) return ''
  const columns: string[] = []
  for (let i = 0, at = 7, n = msg.readInt16BE(5); i < n; i++, at += 18) {
    at = msg.indexOf(0, at) + 1
    columns.push(`${msg.readInt32BE(at + 6)}:${msg.readInt32BE(at + 12)}`)
  }
  return columns.join(',')
}

/** Bind `msg` with the statement it names replaced by `name`. */
function bindNaming(msg: Buffer, name: string): Buffer {
  const portalEnd = msg.indexOf(0, 5)
  const rest = msg.subarray(msg.indexOf(0, portalEnd + 1) + 1)
  const named = Buffer.from(`${name}\0`, 'utf8')
  const head = Buffer.alloc(5)
  head[0] = ClientMessage.Bind
  head.writeInt32BE(4 + (portalEnd + 1 - 5) + named.length + rest.length, 1)
  return Buffer.concat([head, msg.subarray(5, portalEnd + 1), named, rest])
}
const DEALLOCATE = /\bdeallocate\s+(?:prepare\s+)?(?!all\b)("(?:[^"]|"")+"|[a-z_][\w$]*)/gi
const EXECUTE = /\bexecute\s+("(?:[^"]|"")+"|[a-z_][\w$]*)/gi

/** A simple Query that may drop statements: what follows it waits until it has run. */
const DROPS_STATEMENTS = /\b(deallocate|discard)\b/i

/** An ErrorResponse that ends the connection, by its severity: field V (Postgres 9.6+, never translated), each field ending in a NUL. */
const fatal = (msg: Buffer) => msg.includes('\0VFATAL\0', 5) || msg.includes('\0VPANIC\0', 5)

export class StatementRelay {
  /** For bytes (fromClient); a lend's messages come framed already (forward). */
  private client?: Framer
  private readonly server = new Framer()
  private readonly awaited: Awaited[] = []
  /** Client messages held behind a Query that may drop statements, until its ReadyForQuery; or behind a statement being described. */
  private held?: Buffer[]
  /** The statement being described that `held` waits for (undefined: a Query's ReadyForQuery). */
  private heldFor?: string
  /** Statements prepared again during this lend to learn their result type. */
  private checked?: Set<string>
  /** The reset that goes at the head of the next write, when the backend changes hands (see handOver). */
  private ahead?: Buffer
  /** Whether a ParameterStatus goes to the client (the session's own filter: see LentSession). */
  onParameter?: (msg: Buffer) => boolean
  /** Postgres said it ran something other than plain reads and writes (a command tag, a function call's answer) since this was last cleared. */
  unusual = false
  /** Postgres's tags said LISTEN or UNLISTEN ran since the last ReadyForQuery(I). */
  private listened = false
  /**
   * From a transaction's last ReadyForQuery on, what Postgres sends is held here rather than passed
   * (see releaseOut): after LISTEN or UNLISTEN, or where `holdsAtIdle` says (the session listens, and
   * Postgres's account of its channels after the transaction comes first: proxy/notify/).
   */
  heldOut?: Buffer[]
  private holdFrom = 0
  holdsAtIdle?: () => boolean
  /** A notification on this backend: what goes to the client in its place (`msg` itself, another, or false: nothing). */
  onNotification?: (msg: Buffer) => Buffer | false

  constructor(
    private readonly session: SessionStatements,
    private backend: BackendStatements,
    private toBackend: (bytes: Buffer) => void,
    /** A statement of the session's is being prepared on this backend again. */
    private readonly preparedAgain?: () => void
  ) {}

  /**
   * Messages of the proxy's own (the reset of a backend that changes hands, proxy/isolation/verify.ts
   * handoverReset; claims on a standby) go at the head of the next write, in one Sync group with what
   * follows them: `ends` of their answers end in a CommandComplete or a ReadyForQuery. `answered` hears
   * whether Postgres ran them all (false: an error, and Postgres skips the rest of the group). Until
   * then, what Postgres sends is the last user's (a notification, a notice) and goes nowhere. Called
   * before anything is written.
   */
  lead(bytes: Buffer, ends: number, answered: (ok: boolean) => void) {
    this.ahead = bytes
    this.awaited.push({ kind: 'handover', own: true, left: ends, answered })
  }

  private write(parts: Buffer[]) {
    if (this.ahead) parts.unshift(this.ahead), (this.ahead = undefined)
    this.toBackend(parts.length === 1 ? parts[0] : Buffer.concat(parts))
  }

  /**
   * Sends `query`, messages of the proxy's own ending in their one ReadyForQuery (a Query, or a
   * Sync), behind the session's: its answers are not the client's. `onRow` gets each row's first
   * value; `ready`, at its ReadyForQuery, the transaction status.
   */
  ownQuery(own: Own) {
    this.write([own.query])
    this.awaits(own)
  }

  /** Every answer up to the next ReadyForQuery is `own`'s. */
  private awaits({ onRow, ready }: Own) {
    this.awaited.push({ kind: 'sync', own: true, swallow: true, onRow, ready })
  }

  /** ReadyForQuery messages Postgres still owes the proxy's own Queries and Syncs. */
  get ownReadiesDue(): number {
    return this.awaited.filter((a) => a.kind === 'sync' && a.own).length
  }

  /**
   * The unnamed statement and portal on the backend are another session's until this one makes its
   * own: one that names them before that finds none, as on a connection of its own.
   */
  private unnamed = { statement: false, portal: false }

  /** Nothing under way: every answer in, nothing held or half read (as at the end of a lend, as a rule). */
  get quiet(): boolean {
    return !this.awaited.length && !this.held && !this.ahead && !this.run && !this.server.holding && !this.heldOut
  }

  /** What was held from a transaction's end on (see heldOut), for the client now. */
  releaseOut(): Buffer {
    const out = this.heldOut ?? []
    this.heldOut = undefined
    return out.length === 1 ? out[0] : Buffer.concat(out)
  }

  /** The session's next backend, for a relay that is quiet: it serves that one from now on, as a new relay would. */
  lendTo(backend: BackendStatements, toBackend: (bytes: Buffer) => void) {
    this.backend = backend
    this.toBackend = toBackend
    this.checked = undefined
    this.unnamed.statement = this.unnamed.portal = false
    this.unusual = this.listened = false
  }

  /** Client → backend: whole messages, with the proxy's own before those that name a statement. */
  fromClient(chunk: Buffer) {
    this.forward((this.client ??= new Framer()).push(chunk))
  }

  /** What the last fromBackend passed to the client: its ReadyForQuery messages, the last one's status, and the last message's type (0: none). */
  passedReadies = 0
  passedStatus = 0
  passedLast = 0

  /** Part of a message of Postgres's is held until the rest comes. */
  get holding(): boolean {
    return this.server.holding > 0
  }

  /** Backend → client: Postgres's answers, but those to the proxy's own messages. */
  fromBackend(chunk: Buffer): Buffer {
    this.passedReadies = this.passedLast = 0
    this.server.each(chunk, this.answer)
    this.endRun()
    const runs = this.runs
    if (this.heldOut) this.heldOut.push(...runs.splice(this.holdFrom)), (this.holdFrom = 0)
    if (runs.length < 2) return runs.pop() ?? EMPTY
    this.runs = []
    return Buffer.concat(runs)
  }

  /** What goes to the client, as runs of adjacent bytes (most often one: the chunk, or its end behind answers to the proxy's own). */
  private runs: Buffer[] = []
  private run?: Buffer
  private runStart = 0
  private runEnd = 0

  private pass(bytes: Buffer, start: number, end: number) {
    if (bytes === this.run && start === this.runEnd) return void (this.runEnd = end)
    this.endRun()
    this.run = bytes
    this.runStart = start
    this.runEnd = end
  }

  private endRun() {
    const run = this.run
    if (!run) return
    this.runs.push(this.runStart === 0 && this.runEnd === run.length ? run : run.subarray(this.runStart, this.runEnd))
    this.run = undefined
  }

  /** Postgres's message at `start` to `end` of `bytes` (a view of it made only where it is read further): passed to the client, another in its place, or nothing (an answer to the proxy's own). */
  private readonly answer = (bytes: Buffer, start: number, end: number) => {
    const type = bytes[start]
    const own = this.awaited[0]
    if (own?.kind === 'handover') {
      if (type === ServerMessage.ErrorResponse) this.awaited.shift(), own.answered!(false)
      else if ((type === ServerMessage.CommandComplete || type === ServerMessage.ReadyForQuery) && !--own.left!) this.awaited.shift(), own.answered!(true)
      return
    }
    if (own?.kind === 'describe' && (type === ServerMessage.ParameterDescription || type === ServerMessage.RowDescription || type === ServerMessage.NoData)) {
      if (type !== ServerMessage.ParameterDescription) this.awaited.shift(), own.described?.(resultType(bytes.subarray(start, end)))
      return
    }
    if (type === ServerMessage.NotificationResponse && this.onNotification) {
      const msg = bytes.subarray(start, end)
      const out = this.onNotification(msg)
      if (!out) return
      if (out !== msg) return (this.passedLast = type), this.pass(out, 0, out.length)
    }
    // A notification comes whenever, and is the session's; so is a FATAL, the backend's last word.
    if (own?.swallow && type !== ServerMessage.NotificationResponse && !(type === ServerMessage.ErrorResponse && fatal(bytes.subarray(start, end)))) {
      if (type === ServerMessage.DataRow && bytes.readInt16BE(start + 5) > 0 && bytes.readInt32BE(start + 7) >= 0) own.onRow?.(bytes.toString('utf8', start + 11, start + 11 + bytes.readInt32BE(start + 7)))
      if (type === ServerMessage.ReadyForQuery) this.awaited.shift(), own.ready?.(bytes[start + 5])
      return
    }
    if (type === ServerMessage.ParameterStatus && this.onParameter && !this.onParameter(bytes.subarray(start, end))) return
    if (type === ServerMessage.ParseComplete || type === ServerMessage.CloseComplete) {
      const answered = this.awaited.shift()
      answered?.done?.()
      if (answered?.own) return
    } else if (type === ServerMessage.ErrorResponse) {
      // The message it answers failed, and Postgres skips the rest of its Sync group.
      const ahead = this.awaited[0]?.ahead
      while (this.awaited.length && this.awaited[0].kind !== 'sync') this.awaited.shift()!.skipped?.()
      if (ahead) return // (the Query behind says what is wrong, in its own words)
      if (bytes.subarray(start, end).includes(TYPE_CHANGED)) return (this.passedLast = type), this.pass(TYPE_CHANGED_ERROR, 0, TYPE_CHANGED_ERROR.length)
    } else if (type === ServerMessage.ReadyForQuery) {
      // It answers a Sync (or Query): what is awaited ahead of that, Postgres skipped after an error
      // (sent into the group once the error was in: a Close behind a failed portal).
      while (this.awaited.length && this.awaited[0].kind !== 'sync') this.awaited.shift()!.skipped?.()
      const answered = this.awaited.shift()
      if (answered?.own) return
      if (bytes[start + 5] === TxStatus.Idle && this.backend.portals.size) this.backend.portals.clear()
      if (answered?.deallocates && this.held && this.heldFor === undefined) {
        const held = this.held
        this.held = undefined
        this.forward(held)
      }
    } else if (type === ServerMessage.CommandComplete && !rowsTag(bytes, start + 5, end)) {
      const tag = bytes.toString('utf8', start + 5, end - 1)
      this.undo(tag)
      if (!plainTag(tag)) this.unusual = true
      if (tag === 'LISTEN' || tag === 'UNLISTEN') this.listened = true
    } else if (type === ServerMessage.FunctionCallResponse) this.unusual = true
    if (type === ServerMessage.ReadyForQuery) {
      this.passedReadies++
      this.passedStatus = bytes[start + 5]
      if (this.passedStatus === TxStatus.Idle && !this.heldOut && this.holdsAtIdle && (this.listened || this.holdsAtIdle())) this.endRun(), (this.heldOut = []), (this.holdFrom = this.runs.length)
      if (this.passedStatus === TxStatus.Idle) this.listened = false
    }
    this.passedLast = type
    this.pass(bytes, start, end)
  }

  /**
   * Client → backend, as whole messages already framed (fromClient for bytes). `skipped`: Postgres
   * is skipping messages until the next Sync (an error came while they were held): they go as they are.
   * `behind`: messages of the proxy's own to send in the same write, right behind them (as ownQuery),
   * if none of them waits here for Postgres first; whether they went.
   */
  forward(msgs: Buffer[], skipped = false, behind?: Own[]): boolean {
    if (this.held) return this.held.push(...msgs), false
    const out: Buffer[] = []
    const { session, backend } = this
    for (let i = 0; i < msgs.length; i++) {
      const msg = msgs[i]
      const type = msg[0]
      if (skipped) {
        out.push(msg)
        if (type === ClientMessage.Sync) (skipped = false), this.awaited.push(SYNCED)
        continue
      }
      if (type === ClientMessage.Parse) {
        const name = msg[5] === 0 ? '' : cString(msg.subarray(5))
        // (an unnamed statement lasts until the next Parse: nothing to keep)
        if (name) this.reconcile(name, out, false)
        else this.unnamed.statement = true
        if (name && !session.has(name)) {
          // Held from now on, for the messages behind it; unless Postgres refuses it.
          this.makeRoom(out, false)
          session.set(name, msg)
          backend.use(name, msg)
          backend.types.delete(name)
          this.awaited.push({ kind: 'parse', skipped: () => (session.delete(name), backend.held.delete(name)) })
          this.awaited.push({ kind: 'describe', own: true, described: (type) => (firstTypes.set(msg, type), backend.types.set(name, type)) })
          out.push(msg, serialize.describe({ type: 'S', name }))
          continue
        } else this.awaited.push(PARSED)
      } else if (type === ClientMessage.Bind) {
        const portalEnd = msg.indexOf(0, 5)
        const portal = portalEnd === 5 ? '' : msg.toString('utf8', 5, portalEnd)
        const name = msg[portalEnd + 1] === 0 ? '' : cString(msg.subarray(portalEnd + 1))
        if (name && this.reconcile(name, out, portal === '')) {
          // Prepared again here: its result type is known once Postgres has described it.
          out.push(FLUSH)
          this.held = msgs.slice(i)
          this.heldFor = name
          break
        }
        if (!name) this.ownUnnamed('statement', out)
        if (!portal) this.unnamed.portal = true
        backend.portals.set(portal, name)
        if (name && this.typeChanged(name)) {
          out.push(bindNaming(msg, TYPE_CHANGED))
          continue
        }
      } else if (type === ClientMessage.Describe || type === ClientMessage.Close) {
        const name = msg[5] === DescribeTarget.Statement ? cString(msg.subarray(6)) : ''
        if (name) this.reconcile(name, out, false)
        else if (type === ClientMessage.Describe && msg.length === 7) this.ownUnnamed(msg[5] === DescribeTarget.Statement ? 'statement' : 'portal', out)
        if (type === ClientMessage.Close) {
          if (msg[5] !== DescribeTarget.Statement) backend.portals.delete(cString(msg.subarray(6)))
          this.awaited.push({ kind: 'close', done: name ? () => (session.delete(name), backend.held.delete(name)) : undefined })
        }
      } else if (type === ClientMessage.Execute) {
        if (msg[5] === 0) this.ownUnnamed('portal', out)
      } else if (type === ClientMessage.Sync) this.awaited.push(SYNCED)
      else if (type === ClientMessage.Query) {
        const text = cString(msg.subarray(5))
        // SQL's EXECUTE and DEALLOCATE name the protocol's statements too.
        const named = (re: RegExp) => [...text.matchAll(re)].map((m) => (m[1][0] === '"' ? m[1].slice(1, -1).replace(/""/g, '"') : m[1].toLowerCase()))
        const deallocates = named(DEALLOCATE)
        const before = this.awaited.length
        for (const name of [...named(EXECUTE), ...deallocates]) this.reconcile(name, out, false)
        if (this.awaited.length > before) {
          // A Query is not skipped after an error as extended messages are: the proxy's own get a Sync of their own.
          for (const a of this.awaited.slice(before)) a.ahead = true
          out.push(SYNC)
          this.awaited.push({ kind: 'sync', own: true })
        }
        this.awaited.push({ kind: 'sync', deallocates })
        if (DROPS_STATEMENTS.test(text) && i < msgs.length - 1) {
          out.push(msg)
          this.held = msgs.slice(i + 1)
          break
        }
      }
      out.push(msg)
    }
    const rides = !!behind?.length && !this.held
    if (rides) for (const own of behind!) out.push(own.query), this.awaits(own)
    if (out.length) this.write(out)
    return rides
  }

  /**
   * Makes the backend hold the session's statement `name`, or none, before a message naming it
   * (`replacing` the unnamed portal: its statement may be closed). A copy with the same text but
   * another result type than the session's is prepared again (once per lend: it may have been
   * prepared before DDL the session's was prepared after). True when it was prepared again and the
   * session's result type is known: Postgres is describing it, and what names it waits (see `forward`).
   */
  private reconcile(name: string, out: Buffer[], replacing: boolean): boolean {
    const { held, types } = this.backend
    const wanted = this.session.get(name)
    const holds = held.get(name)
    if (wanted && holds?.equals(wanted) && (this.checked?.has(name) || !this.typeChanged(name))) return this.backend.use(name, wanted), false
    if (holds) this.close(name, holds, out)
    if (!wanted) return false
    this.makeRoom(out, replacing)
    out.push(wanted, serialize.describe({ type: 'S', name }))
    this.preparedAgain?.()
    // Held from now on for the messages behind it; unless an error makes Postgres skip it.
    this.backend.use(name, wanted)
    types.delete(name)
    this.checked ??= new Set()
    this.checked.add(name)
    const release = (skipped: boolean) => {
      if (this.heldFor !== name) return
      const waiting = this.held!
      this.held = this.heldFor = undefined
      this.forward(waiting, skipped)
    }
    this.awaited.push({ kind: 'parse', own: true, skipped: () => held.delete(name) })
    this.awaited.push({ kind: 'describe', own: true, described: (type) => (types.set(name, type), release(false)), skipped: () => release(true) })
    return firstTypes.has(wanted)
  }

  /** Whether the backend's copy of the session's statement `name` returns another type than the session's did at first. */
  private typeChanged(name: string): boolean {
    const first = firstTypes.get(this.session.get(name)!)
    const now = this.backend.types.get(name)
    return first !== undefined && now !== undefined && first !== now
  }

  /** Before a message names the unnamed statement or portal the session never made here: closed, so that Postgres says there is none. */
  private ownUnnamed(which: 'statement' | 'portal', out: Buffer[]) {
    if (this.unnamed[which]) return
    this.unnamed[which] = true
    out.push(serialize.close({ type: which === 'statement' ? 'S' : 'P', name: '' }))
    this.awaited.push({ kind: 'close', own: true })
  }

  /** Closes the least recently used statements (none a portal rests on) till one more fits. */
  private makeRoom(out: Buffer[], replacing: boolean) {
    const { held, limit } = this.backend
    for (const [oldest, parse] of held) {
      if (held.size < limit) break
      if (!this.backend.inUse(oldest, replacing)) this.close(oldest, parse, out)
    }
  }

  private close(name: string, parse: Buffer, out: Buffer[]) {
    out.push(serialize.close({ type: 'S', name }))
    this.backend.held.delete(name)
    this.awaited.push({ kind: 'close', own: true, skipped: () => this.backend.held.set(name, parse) })
  }

  /** DEALLOCATE and DISCARD ALL drop statements the protocol made too. */
  private undo(tag: string) {
    if (tag === 'DEALLOCATE ALL' || tag === 'DISCARD ALL') {
      this.session.clear()
      this.backend.held.clear()
    } else if (tag === 'DEALLOCATE') {
      const name = this.awaited.find((a) => a.kind === 'sync')?.deallocates?.shift()
      if (name !== undefined) this.session.delete(name), this.backend.held.delete(name)
    }
  }
}
