/**
 * A session in transaction pooling: it holds a backend only while it runs something, from its
 * first message after ReadyForQuery(I) to the next ReadyForQuery(I), and none in between.
 *
 * When a transaction ends the session gives its backend back, unless it left state behind: a
 * transaction that did more than plain reads and writes (by Postgres's parser and its command tags,
 * proxy/isolation/reader.ts) is followed by the backend's own account of what is left
 * (proxy/isolation/verify.ts), and where anything is, the session keeps that backend ("pinned"),
 * until a later verification finds it clean. Named prepared statements follow it from
 * backend to backend (proxy/pool/prepared.ts). currval() and lastval() hold only within the
 * transaction that called nextval(): the verification that follows it discards them.
 */
import type { WebSocket, RawData } from 'ws'
import type { Backend } from '../pool/backends'
import type { Holder, Lender } from '../pool/lender'
import { IdleWatch } from '../pool/idle-watch'
import { BackendStatements, StatementRelay, type Own, type SessionStatements } from '../pool/prepared'
import { merge, NOTHING, type Reading } from '../isolation/reader'
import type { SignalKind, Signals } from './signals'
import { found } from '../isolation/verify'
import { Framer, kept, MessageTooLarge } from '../wire/bytes'
import { ClientMessage, ServerMessage, TxStatus } from '../wire/codes'
import { cString, errorResponse, type BackendKey } from '../wire/startup'
import type { BufferBudget, SessionMemory } from './budget'
import { cancelNamed } from './cancels'
import { setClaims, type ClaimsError } from '../auth/claims'
import { closeWebSocket, type OutcomeKind, type RunningSession, type SessionLog } from './session'

export interface LentSessionOptions {
  lender: Lender
  /** The login's answer, sent first. */
  answer: Buffer
  loginBytes: number
  peer: string
  upstream: string
  budget?: BufferBudget
  log?: (entry: SessionLog) => void
  onActivity?: () => void
  /** The statement running now, for a cancel: known by the key the session was told until the returned function is called. */
  follow(running: () => BackendKey | undefined): () => void
  /** Statements each backend keeps for the sessions it serves (--pool-statements). */
  statementsPerBackend: number
  /** A login by token: its claims, set on each backend lent to the session before anything of its runs there (proxy/auth/claims.ts). */
  claims?: string
  /** Who the session is for the per-client share of backends: a token's subject, else the client's address. */
  client?: string
  /** End a session idle inside a transaction this long (ms; 0: never), as Postgres's idle_in_transaction_session_timeout would. */
  idleInTransactionMs?: number
  /** The processID the session was told (none a backend has), and where sessions are found by it. */
  pid: number
  signals: Signals
}

interface Lend {
  backend: Backend
  relay: StatementRelay
  watch: IdleWatch
  /** What the transaction's statements may have left behind, as the parser reads them. */
  effects: Reading
}

const HIGH_WATER = 1 << 20
/** What a message waiting for a backend costs beside its bytes (its Buffer: ~110 bytes of heap, measured). */
const QUEUED_COST = 128
/**
 * A FunctionCall (code no statement text shows, which may make a custom setting no catalog shows),
 * or a message the proxy does not know how to read: whatever it did stays with the session.
 */
const UNREAD: Reading = { plain: false, code: true, unseen: true, control: true }
/** Client messages that run nothing by themselves (what they name was read at its Parse). */
const INERT = new Set<number>([ClientMessage.Describe, ClientMessage.Execute, ClientMessage.Sync, ClientMessage.Flush, ClientMessage.Close, ClientMessage.CopyData, ClientMessage.CopyDone, ClientMessage.CopyFail])
/** The statements each backend holds, by backend, as of its last reset (which drops them all). */
const held = new WeakMap<Backend, { resets: number; statements: BackendStatements }>()

/** Backends that hold the verification prepared (proxy/isolation/verify.ts), as of which reset. */
const prepared = new WeakMap<Backend, number>()

function statementsOn(backend: Backend, limit: number): BackendStatements {
  let entry = held.get(backend)
  if (entry?.resets !== backend.resets) held.set(backend, (entry = { resets: backend.resets, statements: new BackendStatements(limit) }))
  return entry.statements
}

export function runLentSession(ws: WebSocket, o: LentSessionOptions): RunningSession {
  return new LentSession(ws, o)
}

class LentSession implements RunningSession {
  private readonly started = Date.now()
  private bytesIn: number
  private bytesOut = 0
  private outcome = 'closed by client'
  private kind: OutcomeKind = 'ok'
  private lend?: Lend
  /** Client messages waiting for a backend, and what they cost (counted with the budget). */
  private waiting: Buffer[] = []
  private queued = 0
  private acquiring = false
  /** What the backend's verification found left, while the session keeps its backend for it. */
  pinned?: string
  /** It set what no catalog shows (proxy/isolation/reader.ts `unseen`): pinned to its end. */
  private pinnedForGood = false
  /** Its transaction ended cleanly and it keeps its backend until another session needs it. */
  private parked = false
  /** Verifications under way: asking its backend what its transactions left (proxy/isolation/verify.ts). */
  private verifying = 0
  private readonly statements: SessionStatements = new Map()
  private readonly framer: Framer
  /** The most it may hold of the client's: one protocol message under way, and what waits for a backend (--max-message-bytes). */
  private readonly maxHeld: number
  private readonly memory?: SessionMemory
  /** The unnamed statement's effects, as last parsed. */
  private unnamed: Reading = NOTHING
  private ended = false
  /** While it waits in line for a backend: how to leave it (when the session ends). */
  private leaveLine?: (reason: Error) => void
  /** ReadyForQuery messages the client has been sent since its login (Postgres's and the proxy's own): names its statements to a cancel. */
  private readies = 0
  /** The statement a cancel was sent for (by readies), so that it is sent once. */
  private cancelled = -1
  private readonly unfollow: () => void
  private readonly unsignal: () => void
  private idleInTransaction?: NodeJS.Timeout
  /** Signals for sessions (pg_terminate_backend…), each sent once the client has read `after` ReadyForQuery. */
  private signalsDue: Array<{ after: number; kind: SignalKind; pid: number }> = []
  /** Nothing runs and the client sends nothing, inside a transaction. */
  private idleInTx = false
  /** Who the session is to the per-client share of backends. */
  private readonly holder?: Holder

  constructor(private readonly ws: WebSocket, private readonly o: LentSessionOptions) {
    this.bytesIn = o.loginBytes
    if (o.client !== undefined) this.holder = { client: o.client, idleInTransaction: () => this.idleInTx, evict: (message) => this.evict('over_share', '25P03', message) }
    this.maxHeld = o.budget?.maxMessageBytes ?? Infinity
    this.framer = new Framer(this.maxHeld)
    this.memory = o.budget?.watch(ws, () => {
      this.end('over_budget', 'closed: over the memory budget (--max-client-buffer)')
      this.finish() // (what it held goes with it)
    })
    this.memory?.loggedIn()
    this.unsignal = o.signals.attach(o.pid, {
      role: o.lender.role,
      // Its statement running now, if any (as a CancelRequest for its processID would).
      cancel: () => this.lend && !this.parked && this.lend.watch.pending > 0 && this.lend.backend.upstream.cancel(this.lend.backend.key),
      terminate: () => this.evict('ok', '57P01', 'terminating connection due to administrator command'),
    })
    // (A lend not parked may be running something: a portal's Execute awaits no Sync. Postgres ignores a cancel while idle.)
    this.unfollow = o.follow(() => (this.lend && !this.parked ? this.lend.backend.key : undefined))
    this.toClient(o.answer)
    ws.on('message', this.onClientMessage)
    ws.on('close', () => {
      this.finish()
      const { peer, upstream, log } = this.o
      log?.({ peer, upstream, durationMs: Date.now() - this.started, bytesIn: this.bytesIn, bytesOut: this.bytesOut, outcome: this.outcome, kind: this.kind, authFailed: false })
    })
    ws.on('error', (err) => this.end('client_error', `client error: ${err.message}`))
  }

  close(kind: 'timeout' | 'shutdown' | 'token_expired', code: number, reason: string, last?: Buffer) {
    this.end(kind, reason.replace(/^edgepg-proxy: /, ''))
    if (last) this.toClient(last)
    closeWebSocket(this.ws, code, reason)
  }

  private end(kind: OutcomeKind, outcome: string) {
    this.kind = kind
    this.outcome = outcome
  }

  // ── client → Postgres ───────────────────────────────────────────────────────────────────────

  private readonly onClientMessage = (data: RawData, isBinary: boolean) => {
    if (this.ended) return
    if (!isBinary) {
      if (this.cancelFrame(data as Buffer)) return
      this.end('client_error', 'refused a text frame')
      return closeWebSocket(this.ws, 1003, 'edgepg-proxy: expected binary frames')
    }
    const chunk = data as Buffer
    this.bytesIn += chunk.length
    this.o.onActivity?.()
    let msgs: Buffer[]
    try {
      msgs = this.framer.push(chunk)
    } catch (err) {
      this.end('client_error', `client error: ${(err as Error).message}`)
      if (err instanceof MessageTooLarge) return this.holdsTooMuch(`a protocol message of ${err.length} bytes`)
      return closeWebSocket(this.ws, 1002, 'edgepg-proxy: not protocol messages')
    }
    const terminate = msgs.findIndex((m) => m[0] === ClientMessage.Terminate)
    if (terminate >= 0) msgs = msgs.slice(0, terminate)
    if (msgs.length) {
      clearTimeout(this.idleInTransaction)
      this.idleInTx = false
      if (this.lend && this.parked) this.o.lender.unpark(this.lend.backend), (this.parked = false)
      if (this.lend) this.send(msgs)
      else {
        for (const m of msgs) this.waiting.push(kept(m)), (this.queued += m.length + QUEUED_COST)
        if (!this.acquiring) this.acquire()
      }
    }
    if (!this.holds()) return
    if (terminate >= 0) {
      this.finish()
      closeWebSocket(this.ws, 1000)
    }
  }

  /**
   * What it holds of the client's (a message under way, messages waiting for a backend) is within
   * --max-message-bytes and counted in the budget: false once it is closed for it.
   */
  private holds(): boolean {
    const bytes = this.framer.holding + this.queued
    if (bytes > this.maxHeld) {
      this.end('client_error', `client error: held ${bytes} bytes of its messages, over the limit of ${this.maxHeld}`)
      return this.holdsTooMuch(this.queued ? 'messages waiting for a backend' : 'a protocol message'), false
    }
    return this.memory?.hold(bytes) ?? true
  }

  /** Closed as ws closes a WebSocket message over the limit. */
  private holdsTooMuch(what: string) {
    this.finish()
    closeWebSocket(this.ws, 1009, `edgepg-proxy: ${what} over --max-message-bytes (${this.maxHeld})`)
  }

  /** What waits for a backend, taken out of the queue. */
  private unqueue(): Buffer[] {
    const msgs = this.waiting
    this.waiting = []
    this.queued = 0
    this.memory?.hold(this.framer.holding)
    return msgs
  }

  /**
   * `cancel <n>` (SUBPROTOCOL_CANCEL): the client has read n ReadyForQuery and wants the statement
   * after them stopped, wherever it runs now. Acted on only while that statement is the one
   * running, once (as in proxy/ws/session.ts).
   */
  private cancelFrame(data: Buffer): boolean {
    const readies = cancelNamed(this.ws, data)
    if (readies === undefined) return false
    const lend = this.lend
    if (lend && !this.parked && readies === this.readies && this.cancelled !== readies) {
      this.cancelled = this.readies
      lend.backend.upstream.cancel(lend.backend.key)
    }
    return true
  }

  private send(msgs: Buffer[]) {
    const lend = this.lend!
    // pg_cancel_backend / pg_terminate_backend of a processID the proxy told: for the session told it
    // (this one, perhaps), once Postgres has run the statement and its answer is on its way to the
    // client (Postgres signals while it runs; acting as it passed by ended targets before it ran).
    let answered = this.readies + lend.watch.pending
    const before = lend.watch.ending
    let read = NOTHING
    for (const m of msgs) {
      const r = this.effectsOf(m)
      read = merge(read, r)
      if (r.signals && m[0] !== ClientMessage.Parse) {
        for (const s of r.signals) {
          const pid = s.pid ?? (m[0] === ClientMessage.Bind ? bindParameter(m, s.param!) : undefined)
          if (pid !== undefined) this.signalsDue.push({ after: answered + 1, kind: s.kind, pid })
          if (this.signalsDue.length > SIGNALS_DUE_MAX) this.sendSignals(1) // (pipelined without end: the oldest now)
        }
      }
      if (m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync) answered++
    }
    const bytes = Buffer.concat(msgs)
    lend.watch.fromClient(bytes)
    // Whole transactions on an idle backend, plain but perhaps running the database's code: verified
    // lightly in the same write, the answer right behind the client's (no write, no wait of its own).
    const last = msgs[msgs.length - 1][0]
    const whole = before?.pending === 0 && before.status === TxStatus.Idle && (last === ClientMessage.Sync || last === ClientMessage.Query)
    const light = whole && read.plain && read.code && !read.control && !read.unseen && !this.pinned
    if (lend.relay.forward(msgs, false, light ? this.verification(lend, 'light') : undefined)) this.verifying++, this.o.lender.events.verified('light')
    else lend.effects = merge(lend.effects, read)
  }

  /** The signals whose statements the client has its answer to, or the first `n` (the session ended: all). */
  private sendSignals(n = 0) {
    if (!this.signalsDue.length) return
    let due = 0
    while (due < this.signalsDue.length && (due < n || this.signalsDue[due].after <= this.readies)) due++
    for (const s of this.signalsDue.splice(0, due)) this.o.signals.send(s.kind, s.pid, this.o.lender.role)
  }

  /** What running `msg` may leave behind. */
  private effectsOf(msg: Buffer): Reading {
    const type = msg[0]
    const { read } = this.o.lender
    if (type === ClientMessage.Query) return read(cString(msg.subarray(5)))
    if (type === ClientMessage.Parse) {
      // (The text follows the name's NUL, whatever bytes the name holds.)
      const nameEnd = msg.indexOf(0, 5)
      const r = read(cString(msg.subarray(nameEnd + 1)))
      if (nameEnd === 5) this.unnamed = r
      return r
    }
    if (type === ClientMessage.Bind) {
      const portalEnd = msg.indexOf(0, 5)
      if (msg[portalEnd + 1] === 0) return this.unnamed
      const parse = this.statements.get(cString(msg.subarray(portalEnd + 1)))
      return parse ? read(cString(parse.subarray(parse.indexOf(0, 5) + 1))) : NOTHING
    }
    return INERT.has(type) ? NOTHING : UNREAD
  }

  private acquire() {
    this.acquiring = true
    this.o.lender.acquire((leave) => (this.leaveLine = leave), this.holder).then(
      (backend) => {
        this.leaveLine = undefined
        const { claims } = this.o
        if (claims === undefined || this.ended) return this.begin(backend)
        // A login by token: its claims on the backend first (proxy/auth/claims.ts).
        setClaims(backend.upstream, claims).then(
          () => this.begin(backend),
          (err: ClaimsError) => {
            this.o.lender.lost(backend) // (closed: it serves no one)
            this.refuseWaiting(err)
          }
        )
      },
      (err: Error & { code?: string }) => {
        this.leaveLine = undefined
        this.refuseWaiting(err, `edgepg-proxy: ${err.message}`)
      }
    )
  }

  /** The backend is the session's now: what waited for it goes (unless the session ended meanwhile). */
  private begin(backend: Backend) {
    this.acquiring = false
    if (this.ended) return this.o.lender.giveBack(backend)
    this.startLend(backend)
    this.send(this.unqueue())
  }

  /** No backend for what waits: each Query and Sync gets Postgres's way of saying no, an error and ReadyForQuery. */
  private refuseWaiting(err: Error & { code?: string }, message = err.message) {
    this.acquiring = false
    if (this.ended) return
    const answers = this.unqueue().filter((m) => m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync).length
    for (let i = 0; i < answers; i++) this.toClient(Buffer.concat([errorResponse(err.code ?? '08006', message, 'ERROR'), READY_IDLE]))
    this.readies += answers
  }

  private startLend(backend: Backend) {
    const statements = statementsOn(backend, this.o.statementsPerBackend)
    const { events } = this.o.lender
    const relay = new StatementRelay(this.statements, statements, (bytes) => void (backend.upstream.write(bytes) || this.ws.pause()), events.preparedAgain)
    this.lend = { backend, relay, watch: new IdleWatch(), effects: NOTHING }
    backend.upstream.onDrain = () => this.ws.resume()
    backend.upstream.on('close', this.onBackendClose)
    const early = backend.upstream.relay(this.fromBackend)
    backend.upstream.resume()
    if (early.length) this.fromBackend(early)
  }

  // ── Postgres → client ───────────────────────────────────────────────────────────────────────

  private readonly fromBackend = (chunk: Buffer) => {
    const lend = this.lend
    if (!lend) return
    const visible = lend.relay.fromBackend(chunk)
    const readies = lend.watch.readies
    lend.watch.fromBackend(visible)
    this.readies += lend.watch.readies - readies
    if (visible.length) this.toClient(visible)
    this.sendSignals()
    // A parked backend speaks only to say it is going away (a FATAL): it stays with this session
    // (which ends as it closes), and no other may take it meanwhile.
    if (this.parked && lend.watch.last === ServerMessage.ErrorResponse) return this.o.lender.unpark(lend.backend), void (this.parked = false)
    const ending = lend.watch.ending
    if (this.lend !== lend || !ending || ending.pending !== 0 || this.waiting.length) return
    if (ending.status === TxStatus.Idle) this.transactionEnded(lend)
    else this.idleInside()
  }

  /** Nothing runs and the client sends nothing, inside a transaction: it may stay so for --idle-in-transaction-timeout. */
  private idleInside() {
    if (this.idleInTx) return
    this.idleInTx = true
    this.o.lender.idleInTransaction() // (another client may be waiting for this backend)
    const ms = this.o.idleInTransactionMs
    if (!ms) return
    this.idleInTransaction = setTimeout(() => {
      const message = `terminating connection due to idle-in-transaction timeout (edgepg-proxy: --idle-in-transaction-timeout ${ms} ms; the transaction was rolled back)`
      this.evict('idle_in_transaction', '25P03', message)
    }, ms)
  }

  /**
   * Ends the session as Postgres ends a connection it will not keep: a FATAL error, then the close.
   * Its backend is reset by the pool (rolled back first), or closed if it is busy or holds what no reset takes.
   */
  private evict(kind: OutcomeKind, code: string, message: string) {
    this.end(kind, message)
    this.toClient(errorResponse(code, message, 'FATAL'))
    this.finish()
    closeWebSocket(this.ws, 1000)
  }

  private readonly resumeBackend = () => this.lend?.backend.upstream.resume()
  private toClient(chunk: Buffer) {
    this.o.onActivity?.()
    this.bytesOut += chunk.length
    const congested = this.ws.bufferedAmount + chunk.length > HIGH_WATER
    this.ws.send(chunk, congested ? this.resumeBackend : undefined)
    if (congested) this.lend?.backend.upstream.pause()
  }

  /**
   * A transaction is over: the backend goes back, unless it may hold what the session set. A plain
   * one (by the parser and by Postgres's command tags) that ran nothing of the database's own is
   * decided at once; one that may have (a relation, a cast, an operator: triggers, rules, policies,
   * views, defaults, made by anyone at any time) after a light verification; any other after a full
   * one. A backend the session keeps anyway is not asked.
   */
  private transactionEnded(lend: Lend) {
    if (this.parked || this.verifying) return
    const e = lend.effects
    const plain = e.plain && !lend.relay.unusual
    lend.effects = NOTHING
    lend.relay.unusual = false
    if (e.unseen) (this.pinnedForGood = true), this.pin('unseen')
    if (this.pinnedForGood || (this.pinned && plain)) return
    if (plain && !e.code) return this.lendOn(lend)
    this.verify(lend, plain ? 'light' : 'full')
  }

  /**
   * Asks the backend what the transaction left, in messages of the proxy's own behind the client's
   * answer (no round trip of its own). The session keeps the backend meanwhile; the transaction is
   * then decided on the answer (or, if the session has begun another, with it).
   */
  private verify(lend: Lend, kind: 'full' | 'light') {
    lend.relay.ownQuery(this.verification(lend, kind))
    this.verifying++
    this.o.lender.events.verified(kind)
  }

  /** A verification's messages, and what its answer decides (see verify). */
  private verification(lend: Lend, kind: 'full' | 'light'): Own {
    const { backend } = lend
    const v = this.o.lender.verification
    const rows: string[] = []
    const query = prepared.get(backend) === backend.resets ? v[kind] : Buffer.concat([v.prepare, v[kind]])
    const ready = (status: number) => {
      this.verifying--
      // (Asked inside a transaction, the answer says nothing of what the transaction will leave.)
      const f = status === TxStatus.Idle ? found(rows) : undefined
      if (f) prepared.set(backend, backend.resets)
      else prepared.delete(backend) // (prepared again next time, in case that is what failed)
      if (this.lend !== lend) return
      const statements = statementsOn(lend.backend, this.o.statementsPerBackend).held.size
      const left = f ? (f.left[0] ?? (f.statements > statements ? 'statements' : undefined)) : 'unverified'
      if (left) return this.pin(left)
      this.unpin()
      const ending = lend.watch.ending
      if (!this.verifying && ending && ending.pending === 0 && ending.status === TxStatus.Idle && !this.waiting.length) this.transactionEnded(lend)
    }
    return { query, onRow: (value) => rows.push(value), ready }
  }

  private pin(reason: string) {
    if (this.pinned) return
    const { lender } = this.o
    if (!lender.pin()) {
      const message = `edgepg-proxy: this session left ${reason === 'unseen' ? 'a setting no reset takes back' : reason} on its backend, and ${lender.shares.pinned} sessions of this user and database already keep theirs (--max-pinned-sessions): the session is closed, its backend cleaned. Keep such state in session pooling (--pool-mode session)`
      return this.evict('over_share', '53400', message)
    }
    this.pinned = reason
    lender.events.pinned(reason)
  }

  private unpin() {
    if (!this.pinned) return
    this.pinned = undefined
    this.o.lender.unpin()
  }

  /** A transaction that left nothing: the backend stays with this session while no other needs it, else goes back. */
  private lendOn(lend: Lend) {
    if (this.o.lender.park(lend.backend, this.surrender)) return void (this.parked = true)
    this.detach(lend)
    this.o.lender.giveBack(lend.backend)
  }

  /** Another session takes the parked backend: from now on this one acquires anew. */
  private readonly surrender = () => {
    this.parked = false
    if (this.lend) this.detach(this.lend)
  }

  private detach(lend: Lend) {
    this.verifying = 0 // (theirs are the backend's: answered there, or lost with it)
    lend.backend.upstream.onDrain = undefined
    lend.backend.upstream.off('close', this.onBackendClose)
    this.lend = undefined
  }

  /**
   * Postgres went away under a lend (parked ones included: the session ran its last transaction
   * there). If it said why (a FATAL: the backend was terminated, or the server is shutting down),
   * the session ends after that word, as a TCP connection to it would:
   * what pg, and code written for it, expect. If it left without a word (the network, a crash),
   * what ran there fails with a clear error and the session goes on, on another backend, unless it
   * had state on that one.
   */
  private readonly onBackendClose = () => {
    const lend = this.lend
    if (!lend) return
    this.detach(lend)
    this.o.lender.lost(lend.backend)
    this.parked = false
    if (lend.watch.last === ServerMessage.ErrorResponse) {
      this.end('ok', 'closed by upstream')
      return closeWebSocket(this.ws, 1000)
    }
    if (this.pinned) {
      this.end('upstream_error', 'upstream error: a pinned backend was lost')
      return closeWebSocket(this.ws, 1011, 'edgepg-proxy: the connection to Postgres was lost, and the session state on it')
    }
    const lost = errorResponse('08006', 'edgepg-proxy: the connection to Postgres was lost while this ran; nothing of its transaction was kept', 'ERROR')
    for (let i = 0; i < lend.watch.pending; i++) this.toClient(Buffer.concat([lost, READY_IDLE]))
    this.readies += lend.watch.pending
  }

  /** The session is over: its backend, if it holds one, goes back (reset, or closed if busy). */
  private finish() {
    if (this.ended) return
    this.ended = true
    clearTimeout(this.idleInTransaction)
    this.sendSignals(Infinity) // (the statements ran: Postgres would have signalled)
    this.unsignal()
    this.unpin()
    this.waiting = []
    this.leaveLine?.(new Error('the session ended'))
    this.unfollow()
    const lend = this.lend
    if (!lend) return
    this.detach(lend)
    if (this.parked) return this.o.lender.giveBack(lend.backend)
    // (The reset waits out what Postgres still owes: the session's answers, and the proxy's own.)
    const ending = lend.watch.ending
    this.o.lender.endSession(lend.backend, ending && { ...ending, pending: ending.pending + lend.relay.ownReadiesDue, reusable: ending.reusable && !this.pinnedForGood })
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

/** Signals a session keeps for statements not yet answered: a client may pipeline without end. */
const SIGNALS_DUE_MAX = 64

const READY_IDLE = Buffer.from([ServerMessage.ReadyForQuery, 0, 0, 0, 5, TxStatus.Idle])
