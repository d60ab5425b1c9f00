/**
 * A session in transaction pooling: it holds a backend only while it runs something, from its
 * first message after ReadyForQuery(I) to the next ReadyForQuery(I), and none in between. This is
 * the lend's relay and lifecycle: the session's messages to the backend it is lent (or to a queue
 * while it waits for one), Postgres's answers back, the lend's end, and the signals its statements
 * ask for. A backend changing hands (its reset, the session's state made again, the question of
 * what a transaction left, and the pin) is proxy/ws/lent-handover.ts's; reads on replicas,
 * proxy/ws/lent-reads.ts's; its protocol-level named statements follow it (proxy/pool/prepared.ts).
 */
import type { WebSocket, RawData } from 'ws'
import type { Backend } from '../pool/backends'
import type { Lender } from '../pool/lender'
import type { Holder } from '../pool/holders'
import { IdleWatch, type Ending } from '../pool/idle-watch'
import { statementsOn, StatementRelay, type SessionStatements } from '../pool/prepared'
import { merge, NOTHING } from '../isolation/reader'
import { SessionReading } from '../isolation/session-reading'
import type { Signals } from './signals'
import { loginReports, SessionState } from '../pool/session-state'
import { Framer, kept, MessageTooLarge } from '../wire/bytes'
import { ClientMessage, ServerMessage, TxStatus } from '../wire/codes'
import { errorResponse, type BackendKey } from '../wire/startup'
import type { BufferBudget, SessionMemory } from './budget'
import { cancelNamed } from './cancels'
import { DueSignals } from './due-signals'
import { setClaims, type ClaimsError } from '../auth/claims'
import { closeWebSocket, type OutcomeKind, type RunningSession, type SessionLog } from './session'
import { HOLD_MAX, POSITIONS_MAX, type OnReplica, type SessionReplicas } from '../replicas/session-reads'
import { SessionPin } from '../pool/pin'
import { POSITION_MESSAGE, SUBPROTOCOL_POSITIONS } from '../../src/config'
import { READY_IDLE, type Lend } from './lend'
import { LentReads, waitsOnReplica, type ReadsHost } from './lent-reads'
import { LentHandover, type HandoverHost } from './lent-handover'
import { sendShared } from './shared-frames'
import { SessionListening, type ListeningHost, type ListenPolicy } from '../notify/session-listening'

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
  /** Reads to the upstream's hot standbys (proxy/replicas/), for a session whose login they can serve. */
  replicas?: SessionReplicas
  /** Bytes of notifications a listening session may fall behind by (--listen-buffer). */
  listenBuffer?: number
  /** The function that says whether a token session may listen on a channel (--listen-policy, a qualified name); none: it may not. */
  listenPolicy?: string
}

const HIGH_WATER = 1 << 20
/** `f` once the code running now is done: a microtask (a resolved promise's, cheaper than queueMicrotask's). */
const RESOLVED = Promise.resolve()
const soon = (f: () => void) => void RESOLVED.then(f)
/** What a message waiting for a backend costs beside its bytes (its Buffer: ~110 bytes of heap, measured). */
const QUEUED_COST = 128
/** How long a listener closed for falling behind has to read what is queued for it, its error last. */
const SLOW_READER_GRACE_MS = 10_000
/** --listen-buffer's default. */
const DEFAULT_LISTEN_BUFFER = 1 << 20
/** Token sessions without --listen-policy may not listen. */
const noPolicy: ListenPolicy = async () => 'LISTEN is refused to sessions signed in with a token unless edgepg-proxy names a policy that allows the channel (--listen-policy schema.function)'

export function runLentSession(ws: WebSocket, o: LentSessionOptions): RunningSession {
  return new LentSession(ws, o)
}

class LentSession implements RunningSession, ReadsHost, HandoverHost {
  private readonly started = Date.now()
  private bytesIn: number
  private bytesOut = 0
  private outcome = 'closed by client'
  private kind: OutcomeKind = 'ok'
  lend?: Lend
  /** Client messages waiting for a backend, and what they cost (counted with the budget). */
  waiting: Buffer[] = []
  private queued = 0
  acquiring = false
  /** It keeps its backend for what its verification found left (proxy/pool/pin.ts). */
  private readonly pin: SessionPin
  /** Its transaction ended cleanly and it keeps its backend until another session needs it. */
  parked = false
  /** Answers of the proxy's own due on the lend (the question after a transaction, a replica's check, the primary's position): the transaction is decided once they are in. */
  verifying = 0
  private readonly statements: SessionStatements = new Map()
  /** What its messages may leave behind, as the parser reads them. */
  private readonly reading: SessionReading
  private readonly framer: Framer
  /** The most it may hold of the client's: one protocol message under way, and what waits for a backend (--max-message-bytes). */
  private readonly maxHeld: number
  private readonly memory?: SessionMemory
  ended = false
  /** While it waits in line for a backend: how to leave it (when the session ends). */
  private leaveLine?: (reason: Error) => void
  /** ReadyForQuery messages the client has been sent since its login (Postgres's and the proxy's own): names its statements to a cancel. */
  private readies = 0
  /** The statement a cancel was sent for (by readies), so that it is sent once. */
  private cancelled = -1
  private readonly unfollow: () => void
  private readonly unsignal: () => void
  private idleInTransaction?: NodeJS.Timeout
  /** Signals for sessions (pg_terminate_backend…) its statements ask for (proxy/ws/due-signals.ts). */
  private readonly signalsDue: DueSignals
  /** Nothing runs and the client sends nothing, inside a transaction. */
  private idleInTx = false
  /** Who the session is to the per-client share of backends. */
  private readonly holder?: Holder
  /** Its reads on replicas, and the primary's positions it sees (proxy/ws/lent-reads.ts). */
  private readonly reads: LentReads
  /** What follows the session from backend to backend: its settings and SQL prepared statements. */
  private readonly state: SessionState
  /** Its backend changing hands, and the question after each transaction (proxy/ws/lent-handover.ts). */
  private readonly handovers: LentHandover
  /** Its LISTEN channels, through its key's one listening backend (proxy/notify/): made when it first may have some. */
  private listened?: SessionListening

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
    this.pin = new SessionPin(o.lender, (message) => this.evict('over_share', '53400', message))
    this.reads = new LentReads(ws, this, o.replicas, o.claims)
    this.signalsDue = new DueSignals(o.signals, o.lender.role)
    this.unsignal = o.signals.attach(o.pid, {
      role: o.lender.role,
      // Its statement running now, if any (as a CancelRequest for its processID would).
      cancel: () => this.lend && !this.parked && this.lend.watch.pending > 0 && this.lend.backend.upstream.cancel(this.lend.backend.key),
      terminate: () => this.evict('ok', '57P01', 'terminating connection due to administrator command'),
    })
    // (A lend not parked may be running something: a portal's Execute awaits no Sync. Postgres ignores a cancel while idle.)
    this.unfollow = o.follow(() => (this.lend && !this.parked ? this.lend.backend.key : undefined))
    this.state = new SessionState(loginReports(o.answer))
    this.handovers = new LentHandover(this, this.pin, this.state, o.statementsPerBackend)
    this.reading = new SessionReading(o.lender.read, this.statements)
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

  get listens(): boolean {
    return !!this.listened?.channels.size
  }

  /** A session that listens hears others' notifications from the hub; its own, from its backend. */
  private readonly heardOnBackend = (msg: Buffer): Buffer | false => (this.listened?.channels.size ? this.listened.fromBackend(msg, this.lend!.backend.key.pid) : msg)

  /**
   * Whether the transaction that just ended may have changed its channels, so that it ends once they
   * are the hub's: it listens already, or is a token session's (its policy decides), and it did more
   * than plain reads and writes. (A standby refuses LISTEN: not asked there.)
   */
  private readonly holdsAtIdle = (): boolean => {
    const lend = this.lend!
    return (this.o.claims !== undefined || !!this.listened?.channels.size) && !(lend.effects.plain && !lend.relay.unusual)
  }

  /** Its channels, made the first time a transaction may have changed them (most sessions never LISTEN). */
  get listening(): SessionListening | undefined {
    const hub = this.o.lender.notifications
    if (this.listened || !hub) return this.listened
    const { claims, listenPolicy: fn } = this.o
    const policy: ListenPolicy | undefined = claims === undefined ? undefined : fn ? (channel) => hub.checks.ask(fn, claims, channel) : noPolicy
    return (this.listened = new SessionListening(hub, this.listeningHost(), this.o.listenBuffer ?? DEFAULT_LISTEN_BUFFER, policy))
  }

  private end(kind: OutcomeKind, outcome: string) {
    this.kind = kind
    this.outcome = outcome
  }

  // ── client → Postgres ───────────────────────────────────────────────────────────────────────

  private readonly onClientMessage = (data: RawData, isBinary: boolean) => {
    if (this.ended) return
    if (!isBinary) {
      if (this.cancelFrame(data as Buffer) || this.reads.seen.afterFrame(data as Buffer)) return
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
    if (this.ws.protocol === SUBPROTOCOL_POSITIONS && msgs.some((m) => m[0] === POSITION_MESSAGE)) {
      const rest = this.reads.seen.takePositions(msgs)
      if (!rest) {
        this.end('client_error', `refused a position message over ${POSITIONS_MAX} bytes`)
        return closeWebSocket(this.ws, 1002, 'edgepg-proxy: position message too long')
      }
      msgs = rest
    }
    const terminate = msgs.findIndex((m) => m[0] === ClientMessage.Terminate)
    if (terminate >= 0) msgs = msgs.slice(0, terminate)
    if (msgs.length) {
      clearTimeout(this.idleInTransaction)
      this.idleInTx = false
      if (this.lend && this.parked) {
        // (Parked where the next transaction should not run: given back, and it is lent anew.)
        if (this.reads.route(msgs) !== 'primary') this.surrenderParked()
        else this.lend.lender.unpark(this.lend.backend), (this.parked = false)
      }
      if (this.lend && !waitsOnReplica(this.lend)) this.send(msgs)
      else {
        this.queue(msgs)
        if (!this.lend && !this.acquiring) this.acquire()
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

  /**
   * A ParameterStatus goes to the client only where it changes what the client was told: a reset
   * on a backend that changed hands reports the previous session's settings going back to the login's.
   */
  private readonly parameter = (msg: Buffer): boolean => {
    const nameEnd = msg.indexOf(0, 5)
    return this.state.report(msg.toString('utf8', 5, nameEnd), msg.toString('utf8', nameEnd + 1, msg.length - 1))
  }

  private queue(msgs: Buffer[]) {
    let bytes = 0
    for (const m of msgs) bytes += m.length
    // (Views that are most of the one buffer they share, a WebSocket message's, are kept as they are: kept() of each would copy them all.)
    const most = msgs.length > 0 && msgs.every((m) => m.buffer === msgs[0].buffer) && bytes * 2 >= msgs[0].buffer.byteLength
    for (const m of msgs) this.waiting.push(most ? m : kept(m)), (this.queued += m.length + QUEUED_COST)
  }

  /** What waits for a backend, taken out of the queue. */
  unqueue(): Buffer[] {
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

  next() {
    if (this.waiting.length && !this.acquiring) this.acquire()
  }

  pinned(): boolean {
    return !!this.pin.reason
  }

  refusedOnReplica() {
    this.reads.refused = true
  }

  get lender(): Lender {
    return this.o.lender
  }

  /** What waits for a backend, ahead of what waits already: the session's own copies of what it sent on a lend that could not keep it. */
  requeue(msgs: Buffer[]) {
    this.waiting = [...msgs, ...this.waiting]
    this.queued += msgs.reduce((n, m) => n + m.length + QUEUED_COST, 0)
  }

  /** `owned`: they are the session's own copies (from its queue), not views of what the client sent. */
  send(msgs: Buffer[], owned = false) {
    const lend = this.lend!
    const handover = lend.handover
    if (handover) {
      // Behind the reset, up to the first Sync: Postgres skips them all if it refuses the reset, and
      // nothing after that Sync may run before its answer says it did not. (Copies kept to send again
      // are bounded as a replica's are: past that, what follows waits in the queue, counted.)
      if (handover.synced) return this.queue(msgs)
      const sync = msgs.findIndex((m) => m[0] === ClientMessage.Sync)
      if (sync >= 0) this.queue(msgs.slice(sync + 1)), (msgs = msgs.slice(0, sync + 1)), (handover.synced = true)
      for (const m of msgs) handover.sent.push(owned ? m : kept(m)), (handover.bytes += m.length)
      if (handover.bytes > HOLD_MAX) handover.synced = true
    }
    if (!msgs.length) return
    // pg_cancel_backend / pg_terminate_backend of a processID the proxy told: for the session told it
    // (this one, perhaps), once Postgres has run the statement and its answer is on its way to the
    // client (Postgres signals while it runs; acting as it passed by ended targets before it ran).
    let answered = this.readies + lend.watch.pending
    // (Where Postgres last said the session was, if it has answered all that went before.)
    const status = lend.watch.pending === 0 ? lend.watch.status : undefined
    const settled = lend.watch.settled
    let read = NOTHING
    let bytes = 0
    for (const m of msgs) {
      const r = this.reading.of(m)
      read = merge(read, r)
      lend.watch.sent(m)
      bytes += m.length
      if (r.signals) this.signalsDue.add(m, r, answered + 1)
      if (m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync) answered++
    }
    if (lend.onReplica) this.reads.sent(lend, msgs, bytes, owned)
    else if (settled === TxStatus.Idle) this.o.replicas?.set.events.routed('primary') // (a replica's, once its answer stands)
    const last = msgs[msgs.length - 1][0]
    const behind = this.reads.behind(lend, read, last === ClientMessage.Sync || last === ClientMessage.Query, status)
    lend.effects = merge(lend.effects, read)
    if (!lend.relay.forward(msgs, false, behind) && behind) this.reads.unsent(lend)
    this.pin.mayLeave(true) // (if pinned: what it runs may release what it keeps)
  }

  acquire() {
    this.acquiring = true
    this.reads.acquire(this.waiting)
  }

  acquireOn(lender: Lender, onReplica?: OnReplica) {
    this.acquiring = true
    this.reads.asked()
    this.askedOf = lender
    this.askedFor = onReplica
    lender.request(this.given, this.refused, this.inLine, this.holder)
  }

  /** Whose backend the session waits for (one request at a time: see acquiring), and for a replica's lend, what may still move it. */
  private askedOf?: Lender
  private askedFor?: OnReplica
  /** The backend given, until the microtask that begins the lend. */
  private givenBackend?: Backend
  // (Not at once: a backend may be given from within another session's handling of its backend's answer.)
  private readonly given = (backend: Backend) => void ((this.givenBackend = backend), soon(this.lent))
  private readonly refused = (err: Error & { code?: string }) => soon(() => this.notLent(err))
  private readonly inLine = (leave: (reason: Error) => void) => void (this.leaveLine = leave)

  private readonly lent = () => {
    const backend = this.givenBackend!
    const lender = this.askedOf!
    const onReplica = this.askedFor
    this.givenBackend = undefined
    this.leaveLine = undefined
    const { claims, replicas } = this.o
    // (On a standby, a token's claims lead the lend's first group: see begin.)
    if (claims === undefined || onReplica || this.ended) return this.begin(backend, lender, onReplica)
    // A login by token: its claims on the backend first (proxy/auth/claims.ts), and, where reads may go to replicas, the key that vouches for them there.
    setClaims(backend.upstream, claims).then(
      () => replicas?.claimsKey.learn(backend.upstream).then(() => this.begin(backend, lender)) ?? this.begin(backend, lender),
      (err: ClaimsError) => {
        lender.lost(backend) // (closed: it serves no one)
        this.refuseWaiting(err)
      }
    )
  }

  private notLent(err: Error & { code?: string }) {
    this.leaveLine = undefined
    const onReplica = this.askedFor
    if (onReplica && !this.ended) return this.reads.notLent(onReplica, err)
    this.refuseWaiting(err, `edgepg-proxy: ${err.message}`)
  }

  /** The backend is the session's now: what waited for it goes (unless the session ended meanwhile; on a replica, once it said it may serve). */
  private begin(backend: Backend, lender: Lender, onReplica?: OnReplica) {
    this.acquiring = false
    if (this.ended) return lender.giveBack(backend)
    const change = this.handovers.take(backend, !!onReplica)
    const lend = this.startLend(backend, lender, onReplica)
    this.handovers.lead(lend, change, this.reads.claimsLead(lend))
    if (!this.reads.begun(lend)) this.send(this.unqueue(), true)
  }

  /** What the session sent on a lend that ran none of it, to another backend (the lend's is closed). */
  elsewhere(lend: Lend, sent: Buffer[]) {
    this.detach(lend)
    lend.lender.lost(lend.backend) // (closed)
    this.signalsDue.forgetAfter(this.readies) // (their statements are sent again)
    this.requeue(sent)
    if (!this.acquiring) this.acquire()
  }

  /** No backend for what waits: each Query and Sync gets Postgres's way of saying no, an error and ReadyForQuery. */
  private refuseWaiting(err: Error & { code?: string }, message = err.message) {
    this.acquiring = false
    if (this.ended) return
    const answers = this.unqueue().filter((m) => m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync).length
    for (let i = 0; i < answers; i++) this.toClient(Buffer.concat([errorResponse(err.code ?? '08006', message, 'ERROR'), READY_IDLE]))
    this.readies += answers
  }

  private startLend(backend: Backend, lender: Lender, onReplica?: OnReplica): Lend {
    const statements = statementsOn(backend, this.o.statementsPerBackend)
    const toBackend = (bytes: Buffer) => void (backend.upstream.write(bytes) || this.ws.pause())
    // (The last lend's relay and watch, if they ended with nothing under way, serve this one: a lend per statement.)
    const spare = this.spareRelay
    const watch = this.spareWatch
    this.spareRelay = this.spareWatch = undefined
    spare?.lendTo(statements, toBackend)
    watch?.reset()
    const relay = spare ?? new StatementRelay(this.statements, statements, toBackend, this.o.lender.events.preparedAgain)
    relay.onParameter = this.parameter
    const lend: Lend = (this.lend = { backend, lender, onReplica, delivered: 0, positionDue: 0, relay, watch: watch ?? new IdleWatch(), effects: NOTHING })
    lend.watch.framer = relay
    const hub = this.o.lender.notifications
    relay.onNotification = hub && this.heardOnBackend
    relay.holdsAtIdle = hub && !onReplica ? this.holdsAtIdle : undefined
    backend.upstream.onDrain = this.resumeClient
    backend.upstream.onClose = this.onBackendClose
    const early = backend.upstream.relay(this.fromBackend)
    backend.upstream.resume()
    if (early.length) this.fromBackend(early)
    return lend
  }

  // ── Postgres → client ───────────────────────────────────────────────────────────────────────

  private readonly fromBackend = (chunk: Buffer) => {
    const lend = this.lend
    if (!lend) return
    const visible = lend.relay.fromBackend(chunk)
    if (this.lend !== lend) return // (an answer of the proxy's own, read just now, moved the session on)
    const on = lend.onReplica
    // (A replica's lend whose transaction is over owes the client nothing: a FATAL now is the replica's going away.)
    if (on && !on.held && waitsOnReplica(lend)) return
    lend.watch.received(lend.relay.passedReadies, lend.relay.passedLast, lend.relay.passedStatus)
    if (on?.moving || on?.held) {
      if (this.reads.answered(lend, visible)) return
    } else if (visible.length) this.reads.deliver(lend, visible)
    this.signalsDue.send(this.readies)
    this.listened?.flush()
    // A parked backend speaks only to say it is going away (a FATAL): it stays with this session
    // (which ends as it closes), and no other may take it meanwhile.
    if (this.parked && lend.watch.last === ServerMessage.ErrorResponse) return lend.lender.unpark(lend.backend), void (this.parked = false)
    const settled = lend.watch.settled
    if (this.lend !== lend || settled === undefined || (this.waiting.length && !lend.onReplica)) return
    if (settled === TxStatus.Idle) this.handovers.ended(lend)
    else this.idleInside()
  }

  /** Nothing runs and the client sends nothing, inside a transaction: it may stay so for --idle-in-transaction-timeout. */
  private idleInside() {
    this.pin.mayLeave(false) // (what it runs is over; its transaction is not)
    if (this.idleInTx) return
    this.idleInTx = true
    this.lend?.lender.idleInTransaction() // (another client may be waiting for this backend)
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
  evict(kind: OutcomeKind, code: string, message: string, graceMs?: number) {
    this.end(kind, message)
    this.toClient(errorResponse(code, message, 'FATAL'))
    this.finish()
    closeWebSocket(this.ws, 1000, undefined, graceMs)
  }

  /** Postgres's answers of a lend to the client, counting its ReadyForQuery messages. */
  deliver(lend: Lend, bytes: Buffer) {
    const readies = lend.watch.readies
    this.readies += readies - lend.delivered
    lend.delivered = readies
    if (bytes.length) this.toClient(bytes)
  }

  private readonly resumeBackend = () => this.lend?.backend.upstream.resume()
  private toClient(chunk: Buffer, shared = false) {
    this.o.onActivity?.()
    this.bytesOut += chunk.length
    if (shared) return sendShared(this.ws, chunk) // (a notification: no backend of the session's to hold back)
    const congested = this.ws.bufferedAmount + chunk.length > HIGH_WATER
    this.ws.send(chunk, congested ? this.resumeBackend : undefined)
    if (congested) this.lend?.backend.upstream.pause()
  }

  afterOwn(lend: Lend) {
    this.handovers.afterOwn(lend)
  }

  release(lend: Lend, first?: Buffer) {
    const held = lend.relay.releaseOut()
    if (!this.ended) this.deliver(lend, first ? Buffer.concat([first, held]) : held)
    this.listened?.flush()
  }

  private listeningHost(): ListeningHost {
    const session = this
    return {
      pid: session.o.pid,
      idle: () => {
        const lend = session.lend
        return !lend || session.parked || (lend.watch.pending === 0 && lend.watch.status === TxStatus.Idle && !lend.relay.heldOut)
      },
      toClient: (bytes, shared) => session.toClient(bytes, shared),
      get unsent() {
        return session.ws.bufferedAmount
      },
      // (Behind what it has yet to read: a slow client is given time to reach why.)
      evict: (code, message) => session.evict('over_budget', code, message, SLOW_READER_GRACE_MS),
    }
  }

  /** A transaction that left nothing: the backend stays with this session while no other needs it, else goes back. */
  lendOn(lend: Lend) {
    // (A replica's is not parked: the session's next transaction may be a write, or need a later position.)
    if (!lend.onReplica && lend.lender.park(lend.backend, this.surrender)) return void (this.parked = true)
    this.detach(lend)
    lend.lender.giveBack(lend.backend)
    this.next() // (what came while a replica's lend ended)
  }

  /** The parked backend goes back: the session's next transaction runs elsewhere. */
  private surrenderParked() {
    const lend = this.lend!
    this.parked = false
    this.detach(lend)
    lend.lender.giveBack(lend.backend)
  }

  /** Another session takes the parked backend: from now on this one acquires anew. */
  private readonly surrender = () => {
    this.parked = false
    if (this.lend) this.detach(this.lend)
  }

  private readonly resumeClient = () => this.ws.resume()
  /** The relay and watch of a lend that ended with nothing under way, for the next (see startLend). */
  private spareRelay?: StatementRelay
  private spareWatch?: IdleWatch

  detach(lend: Lend) {
    if (lend.relay.quiet && lend.watch.quiet) (this.spareRelay = lend.relay), (this.spareWatch = lend.watch)
    this.verifying = 0 // (theirs are the backend's: answered there, or lost with it)
    this.pin.mayLeave(false)
    lend.backend.upstream.onDrain = undefined
    lend.backend.upstream.onClose = undefined
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
    if (lend.handover) return this.elsewhere(lend, lend.handover.sent) // (nothing of the session's ran there)
    if (lend.onReplica && this.reads.lost(lend)) return
    // (A transaction's end held for its channels: it committed, but its LISTEN went with the backend.)
    if (lend.relay.heldOut) this.release(lend, errorResponse('08006', 'edgepg-proxy: the connection to Postgres was lost before the LISTEN could be registered: run it again', 'ERROR'))
    this.detach(lend)
    lend.lender.lost(lend.backend)
    this.parked = false
    if (lend.watch.last === ServerMessage.ErrorResponse) {
      this.end('ok', 'closed by upstream')
      return closeWebSocket(this.ws, 1000)
    }
    if (this.pin.reason) {
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
    this.reads.end()
    this.signalsDue.send(this.readies, Infinity) // (the statements ran: Postgres would have signalled)
    this.unsignal()
    this.pin.unpin()
    this.waiting = []
    this.leaveLine?.(new Error('the session ended'))
    this.unfollow()
    this.listened?.end()
    const lend = this.lend
    if (!lend) return
    this.detach(lend)
    if (this.parked) return lend.lender.giveBack(lend.backend)
    lend.lender.endSession(lend.backend, this.ending(lend, !this.pin.forGood))
  }

  /** How a lend's backend is left: the reset waits out what Postgres still owes, the session's answers and the proxy's own. */
  ending(lend: Lend, reusable = true): Ending | undefined {
    const ending = lend.watch.ending
    return ending && { ...ending, pending: ending.pending + lend.relay.ownReadiesDue, reusable: ending.reusable && reusable }
  }
}
