import type { WebSocket, RawData } from 'ws'
import { ByteQueue, messages, ProtocolError } from '../wire/bytes'
import type { LoginOutcome } from '../login/in-upgrade'
import { errorResponse, LoginWatch, UpstreamError, type BackendKey } from '../wire/startup'
import { runStartup, type StartupIO } from '../login/in-band'
import { FIRST_FLIGHT_BYTES, type BufferBudget } from './budget'
import { cancelNamed } from './cancels'
import { TlsError, type Upstream } from '../upstream/connection'
import { IdleWatch, type Ending } from '../pool/idle-watch'
import type { OutcomeKind } from '../admin/metrics'

export type { OutcomeKind }
import { ServerMessage, ClientMessage } from '../wire/codes'

export type { UpstreamTls } from '../upstream/connection'

export interface SessionLog {
  peer: string
  upstream: string
  durationMs: number
  bytesIn: number
  bytesOut: number
  /** How it ended, in words (never a password or a payload). */
  outcome: string
  kind: OutcomeKind
  /** The login failed its authentication: SQLSTATE class 28 from Postgres, or the proxy's SCRAM exchange. */
  authFailed: boolean
  /** Who logged in, to which database (by token: the token's role). Never a password or a token. */
  user?: string
  database?: string
}

export interface SessionOptions extends Pick<StartupIO, 'connect' | 'routeCancel'> {
  /** Postgres, connected by the login in the upgrade, or (in band) by `connect` once the startup is in. */
  upstream: Upstream
  /**
   * What came of the login the upgrade carried (proxy/login/in-upgrade.ts), or why it failed; without one the
   * startup runs in band.
   */
  opened?: LoginOutcome | Error
  /** Bytes the login in the upgrade carried. */
  loginBytes?: number
  peer: string
  /** Ask the client for a cleartext password and authenticate upstream on its behalf. */
  offload: boolean
  /** Whether a cleartext password may cross the client's link. */
  passwordsAllowed: boolean
  log?: (entry: SessionLog) => void
  /**
   * Postgres accepted the login (ReadyForQuery), or the proxy cannot tell (TLS inside the socket):
   * the handshake timeout no longer applies.
   */
  onEstablished?: () => void
  /** What the client's unfinished messages hold, and how large one may be. */
  budget?: BufferBudget
  /** The session's cancel key is valid (proxy/ws/cancels.ts) until the returned function is called. */
  issueKey?: (key: BackendKey) => () => void
  /** TLS inside the socket: the session's key is unknown until the returned function is called. */
  hideKey?: () => () => void
  /** Bytes moved, either way: the idle timeout starts again. */
  onActivity?: () => void
  /**
   * The backend is the pool's: when the session ends it goes back instead of being closed, with
   * how the session left it (undefined: busy).
   */
  giveBack?: (ending: Ending | undefined) => void
  /** Cancels what the backend runs, for a cancel on the session's own WebSocket (SUBPROTOCOL_CANCEL). */
  cancel?: () => void
}

/** Bytes queued on a client's WebSocket past which we stop reading from Postgres. */
const HIGH_WATER = 1 << 20
/** How long a client has to answer our close frame before its connection is cut (ws would wait 30 s). */
const CLOSE_ANSWER_MS = 1000

/**
 * Closes a client's WebSocket. The client may be paused by backpressure: what it still sends is read
 * (and dropped), or its close reply would wait behind that. One that never answers the close is cut
 * after CLOSE_ANSWER_MS, so that it holds its slot no longer.
 */
export function closeWebSocket(ws: WebSocket, code: number, reason?: string, graceMs = CLOSE_ANSWER_MS) {
  ws.resume()
  ws.close(code, reason)
  const cut = setTimeout(() => ws.terminate(), graceMs).unref()
  ws.once('close', () => clearTimeout(cut))
}

/** Terminate: a client that ends its session cleanly sends it last. */
const TERMINATE = Buffer.from([ClientMessage.Terminate, 0, 0, 0, 4])

/**
 * One client's session, once its WebSocket is open: runs the startup phase in band (auth offload)
 * unless the upgrade carried the login or the proxy leaves auth to Postgres, then relays bytes both
 * ways with backpressure, and logs one line when it ends.
 *
 * A client that goes away without Terminate (its WebSocket dropped, or the proxy closing it) may
 * leave a query running: the session remembers the backend's cancel key (BackendKeyData, watched
 * for as it is relayed) so that Upstream.close() can cancel it. The key is unknown when the client
 * runs TLS inside the socket with Postgres itself: such a backend runs its query to the end, unless
 * the operator sets Postgres's `client_connection_check_interval` (PostgreSQL 14+).
 */
export function runSession(ws: WebSocket, o: SessionOptions): RunningSession {
  return new Session(ws, o)
}

export interface RunningSession {
  /** The proxy ends the session (a time limit, a shutdown, an expired token): closed with `code`, the client told why (`last`: a message sent first). */
  close(kind: 'timeout' | 'shutdown' | 'token_expired', code: number, reason: string, last?: Buffer): void
  /** It waits for notifications (LISTEN through the proxy's hub): quiet, but not idle. */
  readonly listens?: boolean
}

class Session implements RunningSession {
  private readonly upstream: Upstream
  private readonly started = Date.now()
  private bytesIn: number
  private bytesOut = 0
  private outcome = 'closed by client'
  private kind: OutcomeKind = 'ok'
  private authFailed = false
  /** Startup is over (or left to Postgres): bytes flow straight through. */
  private relaying = false
  private refused = false
  private readonly fromClient = new ByteQueue()
  /**
   * Watches Postgres's first messages, while they are relayed, for the backend's cancel key (the
   * pool knows a pooled one's) and the end of the login.
   */
  private keyWatch?: LoginWatch
  private backendKey?: BackendKey
  private established = false
  private readonly memory?: { loggedIn(): void }
  /** Undoes issueKey / hideKey. */
  private readonly forget: (() => void)[] = []
  /** The client's last message was Terminate: the backend is exiting by itself. */
  private clientTerminated = false
  /** For a pooled backend: whether the session leaves it idle (and the Terminate that must not reach it). */
  private readonly watch?: IdleWatch
  private abandoned = false
  /** The client's ReadyForQuery count its last cancel named: one cancel per statement. */
  private cancelled = -1
  /** Who the startup in band logged in, to which database (the upgrade's login is named by its caller). */
  private named?: { user: string; database: string }

  constructor(private readonly ws: WebSocket, private readonly o: SessionOptions) {
    this.upstream = o.upstream
    this.bytesIn = o.loginBytes ?? 0
    if (o.giveBack) this.watch = new IdleWatch()
    else this.keyWatch = new LoginWatch()
    this.memory = o.budget?.watch(ws, () => this.ended('over_budget', 'closed: over the memory budget (--max-client-buffer)'))
    ws.on('message', this.onClientMessage)
    this.upstream.onDrain = () => ws.resume()
    this.start()
    // It may have failed or hung up already, while the upgrade was answered.
    this.upstream.error ? this.onUpstreamError(this.upstream.error) : this.upstream.on('error', this.onUpstreamError)
    this.upstream.closed ? this.onUpstreamClose() : this.upstream.on('close', this.onUpstreamClose)
    ws.on('close', () => {
      this.fromClient.fail(new Error('client closed'))
      this.abandon()
      const { peer, log } = this.o
      const { outcome, kind, authFailed, bytesIn, bytesOut } = this
      log?.({ peer, upstream: this.upstream.name, durationMs: Date.now() - this.started, bytesIn, bytesOut, outcome, kind, authFailed, ...this.named })
    })
    ws.on('error', (err) => {
      this.ended('client_error', `client error: ${err.message}`)
      this.abandon()
    })
  }

  private ended(kind: OutcomeKind, outcome: string) {
    this.kind = kind
    this.outcome = outcome
  }

  close(kind: 'timeout' | 'shutdown' | 'token_expired', code: number, reason: string, last?: Buffer) {
    this.ended(kind, reason.replace(/^edgepg-proxy: /, ''))
    // (Only between Postgres's messages: the relay passes its bytes on as they come.)
    if (last && this.relaying && this.watch?.ending?.pending === 0) this.ws.send(last)
    this.closeClient(code, reason)
  }

  // ── the startup ─────────────────────────────────────────────────────────────────────────────

  /** The login the upgrade carried, answered; or the startup in band (auth offload); or straight to relaying. */
  private start() {
    const { opened } = this.o
    if (opened instanceof Error) return this.startupFailed(opened)
    if (opened?.kind === 'cancel') return this.passCancel(opened.why)
    if (opened) {
      // Postgres's answer to the login the upgrade carried: the session's first frame. (A pooled
      // backend's carries the session's own cancel key, and is no answer for the idle watch.)
      if (opened.answer.length) (this.watch ? this.toClient : this.fromUpstream)(opened.answer)
      if (opened.kind !== 'refused') return this.relay(opened.kind !== 'passthrough' || opened.plaintext, opened.kind === 'ready')
      this.refuse(opened.code, opened.message, opened.byProxy)
      return this.closeClient(1000)
    }
    runStartup({
      client: this.fromClient,
      upstream: this.upstream.queue,
      toClient: this.toClient,
      toUpstream: this.toUpstream,
      passwordsAllowed: this.o.passwordsAllowed,
      secureUpstream: () => this.upstream.secure(),
      offload: this.o.offload,
      connect: this.o.connect,
      routeCancel: this.o.routeCancel,
      named: (user, database) => (this.named = { user, database }),
    }).then((result) => {
      if (result.kind === 'refused') return this.refuse(result.code, result.message)
      if (result.kind === 'cancel') return this.passCancel(result.why)
      this.relay(result.kind !== 'passthrough' || result.plaintext)
    }, this.startupFailed)
  }

  /** A CancelRequest: sent on (Postgres hangs up once it has it), or not (`why`), as Postgres would, without a word. */
  private passCancel(why?: string) {
    if (!why) return this.relay(false, true)
    this.ended('cancel_dropped', `cancel not forwarded: ${why}`)
    this.refused = true
    this.closeClient(1000)
  }

  /** The login is over (ReadyForQuery), or out of sight: messages may be large now, and the handshake timeout is off. */
  private loggedIn() {
    if (this.established) return
    this.established = true
    this.memory?.loggedIn()
    this.o.onEstablished?.()
  }

  /** Postgres (or, for a token, the proxy) refused the login with `code`. */
  private refuse(code: string, message: string, byProxy = false) {
    if (byProxy) this.ended('token_refused', `token refused by the proxy: ${code} ${message}`)
    else this.ended('refused_by_postgres', `refused by Postgres: ${code} ${message}`)
    this.authFailed = code.startsWith('28')
    this.refused = true
    this.fromClient.rest() // queries held for a session that will not be: dropped
  }

  /**
   * The startup failed before Postgres could answer: say why as Postgres would, and hang up. TLS the
   * client asked for failed below the protocol: that is reported in a text frame, as the error its
   * own TLS socket would have raised.
   */
  private readonly startupFailed = (err: Error) => {
    if (err instanceof TlsError) {
      this.ended('startup_refused', `TLS to Postgres failed: ${err.message}`)
      this.ws.send(JSON.stringify({ message: err.message, code: err.code }))
      return this.closeClient(1000)
    }
    if (!(err instanceof ProtocolError || err instanceof UpstreamError)) return // the upstream (or the session) closed first
    this.ended('startup_refused', `startup refused: ${err.message}`)
    this.authFailed = err instanceof ProtocolError && err.code === '28P01' // (the proxy's own SCRAM exchange rejected it)
    this.toClient(errorResponse(err instanceof ProtocolError ? err.code : '08P01', err.message))
    this.closeClient(1000)
  }

  // ── relaying ────────────────────────────────────────────────────────────────────────────────

  /**
   * From here on, both ways, bytes as they come; `loggedIn` if Postgres's ReadyForQuery is already
   * through, else the login watch sees it go by.
   */
  private relay(plaintext: boolean, loggedIn = false) {
    this.relaying = true
    if (!plaintext) {
      // Over TLS inside the socket Postgres's bytes are not protocol messages: no key to find, and
      // no end of the login to see.
      if (!loggedIn) this.forget.push(this.o.hideKey?.() ?? (() => {}))
      this.keyWatch = undefined
      loggedIn = true
    }
    if (loggedIn) this.loggedIn()
    const held = this.fromClient.rest()
    if (held.length) this.toUpstream(held)
    const early = this.upstream.relay(this.fromUpstream)
    if (early.length) this.fromUpstream(early)
    this.ws.resume()
  }

  /** Client → Postgres: relayed, or held (and counted) while the startup runs. */
  private readonly onClientMessage = (data: RawData, isBinary: boolean) => {
    const { ws, watch } = this
    if (ws.readyState !== ws.OPEN || this.upstream.destroyed) return // closing: nothing more to relay
    if (!isBinary) {
      if (this.cancelFrame(data as Buffer)) return
      this.ended('client_error', 'refused a text frame')
      return this.closeClient(1003, 'edgepg-proxy: expected binary frames')
    }
    let chunk = data as Buffer
    this.o.onActivity?.()
    this.bytesIn += chunk.length
    if (watch && this.relaying) {
      if (this.abandoned) return
      chunk = watch.fromClient(chunk)
      if (chunk.length) this.toUpstream(chunk)
      // The session is over: the backend goes back now, not when the WebSocket has closed, so that
      // a session right behind this one finds it.
      if ((this.clientTerminated = watch.terminated)) this.abandon()
      return
    }
    this.clientTerminated = chunk.length >= 5 && chunk.subarray(-5).equals(TERMINATE)
    if (this.relaying) return this.toUpstream(chunk)
    if (this.refused) return // Postgres said no; it is closing, and gets nothing more
    this.fromClient.push(chunk)
    if (this.fromClient.length > FIRST_FLIGHT_BYTES) ws.pause() // pipelined queries wait for upstream auth
  }

  /**
   * `cancel <n>` (SUBPROTOCOL_CANCEL, pooled backends only): the client has read n ReadyForQuery
   * and wants the statement after them stopped. Acted on only while Postgres has sent no more than
   * n, so that a cancel that crossed its statement's end never reaches a later one; once per statement.
   */
  private cancelFrame(data: Buffer): boolean {
    const { cancel } = this.o
    const readies = cancelNamed(this.ws, data)
    if (!cancel || !this.watch || readies === undefined) return false
    if (this.relaying && !this.abandoned && readies === this.watch.readies && readies !== this.cancelled) {
      this.cancelled = readies
      cancel()
    }
    return true
  }

  private readonly toUpstream = (chunk: Buffer) => {
    if (!this.upstream.write(chunk)) this.ws.pause()
  }

  /** Postgres → client, watched on the way (for the cancel key, or whether the session leaves its backend idle). */
  private readonly fromUpstream = (chunk: Buffer) => {
    if (this.keyWatch?.feed(chunk)) {
      const { key, ready } = this.keyWatch
      this.keyWatch = undefined
      if (key) this.forget.push(this.o.issueKey?.((this.backendKey = key)) ?? (() => {}))
      if (ready) this.loggedIn()
    }
    this.watch?.fromBackend(chunk)
    this.toClient(chunk)
  }

  // Only the chunk that crosses the mark gets a callback: nothing is sent after it while paused,
  // so once it is written the queue has drained.
  private readonly resumeUpstream = () => this.upstream.resume()
  private readonly toClient = (chunk: Buffer) => {
    this.o.onActivity?.()
    this.bytesOut += chunk.length
    const congested = this.ws.bufferedAmount + chunk.length > HIGH_WATER
    this.ws.send(chunk, congested ? this.resumeUpstream : undefined)
    if (congested) this.upstream.pause()
  }

  // ── the end ─────────────────────────────────────────────────────────────────────────────────

  /** Ends the session from our side. */
  private closeClient(code: number, reason?: string) {
    closeWebSocket(this.ws, code, reason)
  }

  private readonly onUpstreamError = (err: NodeJS.ErrnoException) => {
    const { connected, name } = this.upstream
    this.ended(connected ? 'upstream_error' : 'upstream_unreachable', connected ? `upstream error: ${err.code ?? err.message}` : `upstream ${name} unreachable: ${err.code ?? err.message}`)
    this.closeClient(1011, `edgepg-proxy: ${this.outcome}`.slice(0, 123))
  }

  private readonly onUpstreamClose = () => {
    const { ws } = this
    // Postgres may refuse (e.g. no such database) and hang up before the client sent its password:
    // pass its ErrorResponse on rather than a bare close.
    if (!this.relaying && !this.refused && ws.readyState === ws.OPEN) {
      const error = firstErrorResponse(this.upstream.queue.rest())
      if (error) {
        this.toClient(error)
        this.ended('refused_by_postgres', 'refused by Postgres before the password')
      }
    }
    if (ws.readyState === ws.OPEN) {
      // After the client's Terminate, Postgres hanging up is the client's doing.
      if (this.kind === 'ok' && !this.clientTerminated) this.outcome = 'closed by upstream'
      this.closeClient(1000)
    }
  }

  /** The client is gone (or done): the backend goes back to the pool, or is closed (its query cancelled unless it was told to end). */
  private abandon() {
    if (this.abandoned) return
    this.abandoned = true
    for (const undo of this.forget) undo()
    const { upstream, o } = this
    if (!o.giveBack) return upstream.close(this.clientTerminated ? undefined : this.backendKey)
    upstream.off('error', this.onUpstreamError)
    upstream.off('close', this.onUpstreamClose)
    upstream.onDrain = undefined
    o.giveBack(this.watch ? this.watch.ending : undefined)
  }
}

/** The first complete ErrorResponse among whole backend messages, if any. */
const firstErrorResponse = (bytes: Buffer) => messages(bytes).find((m) => m[0] === ServerMessage.ErrorResponse)
