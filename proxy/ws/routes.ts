/**
 * The WebSocket routes (/v1, /v2): who may open a session (limits, Origin, upstream), its login
 * (answered by a warm backend, or run at Postgres before the upgrade is answered), then the session.
 */
import http from 'node:http'
import type { Duplex } from 'node:stream'
import { WebSocketServer, type WebSocket } from 'ws'
import { formatHostPort, parseHostPort, type HostPort } from '../upstream/address'
import { runSession, type RunningSession, type SessionLog } from './session'
import { runLentSession } from './lent-session'
import type { Signals } from './signals'
import { Lender, LoginRefused } from '../pool/lender'
import type { Lenders } from '../pool/lenders'
import { Upstream, type ClientTls, type UpstreamTls } from '../upstream/connection'
import { loginAs, passedLogin, redactLogin, runLogin, takeLogin, type Login, type LoginOutcome } from '../login/in-upgrade'
import { passwordsRefused } from '../login/in-band'
import { UNUSED, type Backend, type BackendPool } from '../pool/backends'
import { errorResponse, UpstreamError, type BackendKey } from '../wire/startup'
import type { TokenLogins } from '../auth/token-login'
import type { Identity } from '../auth/tokens'
import { setClaims, type ClaimsError } from '../auth/claims'
import { FIRST_FLIGHT_BYTES, type BufferBudget } from './budget'
import type { LoginGate, LoginTicket } from '../login/gate'
import type { Cancels } from './cancels'
import type { Metrics, RefusalReason } from '../admin/metrics'
import { notAllowed, type Upstreams } from '../upstream/allowed'
import { SUBPROTOCOL, SUBPROTOCOL_CANCEL, SUBPROTOCOL_POSITIONS, SUBPROTOCOL_POSITIONS_FRAMED } from '../../src/config'
import { readOnlyLogin, serializableLogin, type Replicas } from '../replicas/replicas'
import type { SessionReplicas } from '../replicas/session-reads'
import { isLoopback, limitKey } from '../listen/client-address'
import { Refusals } from './refusals'
import { giveAll, takeAll, type Places, type PlacesOf, type Wanted } from '../cluster/places'
import type { KeyMessage } from '../cluster/worker'

/** A token's subject (its claims' `sub`), or its claims whole where it names none. */
function subjectOf(claims: string): string {
  const sub = (JSON.parse(claims) as { sub?: unknown }).sub
  return typeof sub === 'string' ? sub : claims
}

/** An upgrade refused before any session began: who asked, for what, and what they were told. */
export interface UpgradeRefusal {
  peer: string
  path: string
  status: number
  reason: string
}

export interface RouteOptions {
  /** Transaction mode: end a session idle inside a transaction this long (ms; 0: never). */
  idleInTransactionMs?: number
  /** Transaction mode's listening sessions: --listen-buffer, --listen-policy. */
  listenBuffer?: number
  listenPolicy?: string
  /** Transaction mode: sessions by the processID they were told. */
  signals: Signals
  upstreams: Upstreams
  pool: BackendPool
  metrics: Metrics
  upstreamTls?: UpstreamTls
  /** Authenticate upstream on the client's behalf (else the startup is relayed untouched). */
  offload: boolean
  allowInsecurePasswords?: boolean
  allowedOrigins?: string[]
  budget: BufferBudget
  logins: LoginGate
  cancels: Cancels
  /** Transaction pooling (proxy/pool/lenders.ts), for the logins the proxy runs with a password; else each session holds its backend. */
  lenders?: Lenders
  /** Logins by signed token (proxy/auth/); without it a login carrying a token is refused. */
  tokens?: TokenLogins
  /** Hot standbys of the upstream (--replica): transaction pooling's reads may go there. */
  replicas?: Replicas
  /** The client's address (behind a trusted balancer, the one it declares); default the TCP peer's. */
  clientAddress?: (req: http.IncomingMessage) => string
  /** Where the session limits are counted (the whole proxy's, with --workers n). */
  places: PlacesOf
  maxSessions?: number
  maxSessionsPerIp?: number
  handshakeTimeoutMs: number
  idleTimeoutMs?: number
  log?: (entry: SessionLog) => void
  /** Called once per refused upgrade, with the status and the reason its response carries. */
  refusalLog?: (entry: UpgradeRefusal) => void
  /** With --workers: tells the other workers a key just logged in here (see prelogin). */
  announce?: (m: KeyMessage) => void
}

/** Backends logged in ahead of need at once, for keys other workers announce (each a login at Postgres). */
const PRELOGINS_MAX = 4

/** Sent to clients whose session is cut by a shutdown. */
const SHUTDOWN_REASON = 'edgepg-proxy is shutting down'

export class WebSocketRoutes {
  /** Open sessions, by their WebSocket. */
  readonly sessions = new Map<WebSocket, RunningSession>()
  /** Upgrades under way: they count against the limits too. */
  private readonly upgrading = new Set<Duplex>()
  /** Sessions and upgrades under way, in all ('') and by client address. */
  private readonly inAll: Places
  private readonly perIp: Places
  private readonly origins: Set<string>
  private readonly wss: WebSocketServer
  /** Upgrades whose session can take a cancel on its own WebSocket (on a pooled backend, whose messages it follows). */
  private readonly cancelsInBand = new WeakSet<http.IncomingMessage>()
  /** Of those, upgrades whose session may read from replicas: it takes and tells positions (SUBPROTOCOL_POSITIONS). */
  private readonly positioned = new WeakSet<http.IncomingMessage>()
  /** Sessions on a connection of their own to Postgres, made while the pool was full, by client (a token's subject, else an address). */
  private readonly outside = new Map<string, number>()
  private closing = false
  /** Upgrades refused in the last seconds: what their clients ask about (see `answer`). */
  private readonly refusals = new Refusals()

  constructor(private readonly o: RouteOptions) {
    this.origins = new Set(o.allowedOrigins ?? [])
    this.inAll = o.places('sessions', o.maxSessions ?? 10_000)
    this.perIp = o.places('sessionsPerIp', o.maxSessionsPerIp ?? 100)
    // Selecting edgepg's subprotocol says the proxy takes a login from the upgrade (proxy/login/in-upgrade.ts);
    // selecting SUBPROTOCOL_CANCEL, also a cancel on the session's WebSocket (proxy/ws/session.ts);
    // SUBPROTOCOL_POSITIONS (or, from drivers before it, SUBPROTOCOL_POSITIONS_FRAMED), also positions in the WAL,
    // where reads may go to replicas (proxy/replicas/).
    // Any other offered subprotocol is declined (ws would otherwise select the first one offered).
    this.wss = new WebSocketServer({
      noServer: true,
      clientTracking: false, // (the sessions are this.sessions: no Set of ws's own, nor a close listener each)
      maxPayload: FIRST_FLIGHT_BYTES, // until the login is in (proxy/ws/budget.ts)
      perMessageDeflate: false,
      handleProtocols: (offered, req) =>
        offered.has(SUBPROTOCOL_POSITIONS) && this.positioned.has(req) ? SUBPROTOCOL_POSITIONS
        : offered.has(SUBPROTOCOL_POSITIONS_FRAMED) && this.positioned.has(req) ? SUBPROTOCOL_POSITIONS_FRAMED
        : offered.has(SUBPROTOCOL_CANCEL) && this.cancelsInBand.has(req) ? SUBPROTOCOL_CANCEL
        : offered.has(SUBPROTOCOL) ? SUBPROTOCOL : false,
    })
  }

  /** Sessions open, and upgrades on their way to be. */
  get count(): number {
    return this.sessions.size + this.upgrading.size
  }

  /**
   * What refuses an upgrade before any limit is counted: the proxy closing, the path, the browser's
   * Origin, the address it names. Also answers a plain GET of the same URL, which is how a browser's
   * client learns why (a browser shows a refused upgrade's status and text to no one).
   */
  check(req: http.IncomingMessage, url = new URL(req.url ?? '/', 'http://proxy')): { refused: [number, string, RefusalReason] } | { address?: string; named?: HostPort } {
    if (this.closing) return { refused: [503, SHUTDOWN_REASON, 'shutting_down'] }
    if (url.pathname !== '/v1' && url.pathname !== '/v2') return { refused: [404, `no WebSocket route at ${url.pathname}; use /v1 or /v2`, 'not_found'] }
    const origin = req.headers.origin
    if (origin !== undefined && !this.origins.has('*') && !this.origins.has(origin)) return { refused: [403, `origin ${origin} is not allowed (--allow-origin)`, 'origin'] }
    const address = url.searchParams.get('address') ?? undefined
    if (!address) return {}
    let named: HostPort
    try {
      named = parseHostPort(address)
    } catch (err) {
      return { refused: [400, (err as Error).message, 'bad_address'] }
    }
    const picked = this.o.upstreams.pick(named, req.headers.host)
    if (!picked) return { refused: [403, `address ${notAllowed(named, this.o.upstreams.upstream)}`, 'forbidden_address'] }
    return { address, named: picked }
  }

  /**
   * The answer to a plain GET of an upgrade's URL, which a browser's client asks when its WebSocket
   * did not open (browsers show a refused upgrade's answer to no one): the refusal this client got
   * at this URL in the last 10 s (a limit's, say), else what the checks say of it now.
   */
  answer(req: http.IncomingMessage): [status: number, reason: string] {
    const last = this.refusals.last(this.peerOf(req), req.url ?? '/')
    if (last) return last
    const checked = this.check(req)
    return 'refused' in checked ? [checked.refused[0], checked.refused[1]] : [426, 'edgepg-proxy: connect with a WebSocket to /v1 or /v2']
  }

  /** Who sent `req`: its client's address (behind a trusted balancer, the one it declared). */
  private peerOf(req: http.IncomingMessage): string {
    return this.o.clientAddress?.(req) ?? req.socket.remoteAddress ?? '?'
  }

  /** An upgrade request: refused (with a status saying why), or on its way to a session. */
  handle(req: http.IncomingMessage, socket: Duplex, head: Buffer) {
    const { metrics, upstreams } = this.o
    const url = new URL(req.url ?? '/', 'http://proxy')
    const peer = this.peerOf(req)
    const refuse = (status: number, reason: string, why: RefusalReason) => {
      metrics.refused(why)
      this.o.refusalLog?.({ peer, path: url.pathname, status, reason })
      this.refusals.remember(peer, req.url ?? '/', status, reason)
      socket.end(`HTTP/1.1 ${status} ${http.STATUS_CODES[status]}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n${reason}\n`)
    }
    socket.on('error', destroyed)
    const maxSessions = this.o.maxSessions ?? 10_000
    const maxPerIp = this.o.maxSessionsPerIp ?? 100
    const checked = this.check(req, url)
    if ('refused' in checked) return refuse(...checked.refused)
    const { address, named } = checked
    // The limits before anything that costs more (a name's lookup, a login).
    const client = limitKey(peer)
    const held: Wanted = [[this.inAll, ''], [this.perIp, client]]
    const admitted = (full: number) => {
      if (full === 0) return refuse(503, `too many sessions (${maxSessions}); try again later`, 'too_many_sessions')
      if (full === 1) return refuse(429, `too many sessions from ${client} (${maxPerIp})`, 'too_many_sessions_per_ip')
      const release = releaser(held) // (not a closure of this request's: the session keeps it)
      if (!named) return this.accept(req, socket, head, upstreams.upstream, peer, release)
      const { host } = named
      upstreams.admit(named).then(
        (target) => (target ? this.accept(req, socket, head, target, peer, release) : (release(), refuse(403, `address ${address} no longer resolves to an address the allow-list had`, 'forbidden_address'))),
        (err: Error) => (release(), refuse(502, `cannot resolve ${host}: ${err.message}`, 'bad_address'))
      )
    }
    const full = takeAll(held)
    typeof full === 'number' ? admitted(full) : full.then(admitted)
  }

  /**
   * Replicas for a session of the upstream's: the key's lender on each replica is made by the same
   * login, there (a token's: its role's, with its claims set by the replica key, once it is learnt).
   */
  private replicasFor(name: string, login: Login, byToken: boolean): SessionReplicas | undefined {
    const { replicas, lenders, pool, upstreamTls } = this.o
    if (!replicas || !lenders || name !== formatHostPort(this.o.upstreams.upstream) || login.first.kind !== 'startup') return undefined
    const { tls, first, password } = login
    if (serializableLogin(first.packet)) return undefined // (a standby runs no serializable transaction)
    const keys = new Map<string, string>() // (made once a session: every read asks)
    return {
      set: replicas,
      readOnly: readOnlyLogin(first.packet),
      claimsKey: replicas.claimsKey(first.user, first.database || first.user),
      async lender(replica) {
        let key = keys.get(replica.name)
        if (key === undefined) keys.set(replica.name, (key = pool.key(replica.name, tls, first.packet, password, byToken)))
        const there = () => loginAs(replica.target, upstreamTls, login)
        const got = await lenders.lenderFor(key, () => pool.open(key, there), there)
        if (got instanceof Lender) return got
        got.upstream.close()
        const { outcome } = got
        throw outcome.kind === 'refused' ? new LoginRefused(outcome.message, outcome.code) : new Error(`the replica answered the login unexpectedly (${outcome.kind})`)
      },
    }
  }

  /**
   * Stops accepting, lets sessions end by themselves for up to `graceMs`, then closes the rest
   * with code 1001; those that do not answer the close promptly are cut.
   */
  /** Prelogins under way (see prelogin). */
  private prelogging = 0

  /**
   * A key another worker's session just logged in with (proxy/cluster/worker.ts): a backend of it is
   * logged in here ahead of need, and its lender made, so that the key's first login on this worker
   * is answered at once, as its later ones are. Only while the pool has room (a pool that fills
   * closes an idle backend, the least recently used first, for the logins of sessions), and a few at once.
   */
  prelogin(m: KeyMessage) {
    const { lenders, pool, upstreamTls } = this.o
    if (!lenders || lenders.get(m.key) || pool.full || this.prelogging >= PRELOGINS_MAX || this.closing) return
    let login
    try {
      login = passedLogin(m)
    } catch {
      return
    }
    const there = relogin(m.target, upstreamTls, login)
    // (The backend is the announcing client's, as its own would be: held to its share of keys kept warm.)
    const open = () => pool.open(m.key, there).then((opened) => (opened.backend && (opened.backend.client = m.client), opened))
    this.prelogging++
    lenders.lenderFor(m.key, open, there).then(
      (made) => made instanceof Lender || made.upstream?.close(),
      () => {}
    ).finally(() => this.prelogging--)
  }

  async close(graceMs: number) {
    this.closing = true
    const deadline = Date.now() + graceMs
    while (this.sessions.size && Date.now() < deadline) await new Promise((r) => setTimeout(r, Math.min(50, deadline - Date.now())))
    for (const socket of this.upgrading) socket.destroy()
    for (const session of this.sessions.values()) session.close('shutdown', 1001, SHUTDOWN_REASON)
    while (this.sessions.size) await new Promise((r) => setTimeout(r, 20))
  }

  /** The login the upgrade carries goes to a warm backend or to Postgres; its answer opens the session. */
  private accept(req: http.IncomingMessage, socket: Duplex, head: Buffer, target: HostPort, peer: string, release: () => void) {
    if (socket.destroyed) return release()
    const { pool, metrics, offload } = this.o
    const { outside } = this
    this.upgrading.add(socket)
    let passwordsAllowed = 'encrypted' in req.socket || isLoopback(peer) || this.o.allowInsecurePasswords === true
    // The login leaves the headers here: ws negotiates the rest, and nothing logs it.
    const { protocols, login, problem } = takeLogin(req.headers['sec-websocket-protocol'])
    if (protocols === undefined) delete req.headers['sec-websocket-protocol']
    else req.headers['sec-websocket-protocol'] = protocols
    req.rawHeaders = redactLogin(req.rawHeaders)

    const name = formatHostPort(target)
    let up: Upstream | undefined
    /** The pool's backend this session runs on, if any. */
    let backend: Backend | undefined
    let ws: WebSocket | undefined
    /** Its place among the logins waiting on Postgres (proxy/login/gate.ts). */
    let ticket: LoginTicket | undefined
    /** Transaction pooling: the lender whose answer the login got, and the cancel key it told. */
    let lent: { lender: Lender; told: BackendKey } | undefined
    /** A login by token: who it proves (its claims go to Postgres before anything of the session's runs). */
    let identity: Identity | undefined
    /** A token's login, as the proxy makes it: its role, the role's password. */
    let asRole: Login | undefined
    // Nothing connects to Postgres before the login is in, and admitted.
    const newUpstream = () => (up = new Upstream(target, this.o.upstreamTls))
    const connect = async (login: boolean) => {
      if (login) await (ticket = this.o.logins.admit(limitKey(peer))).admitted
      const started = performance.now()
      up!.connect(() => metrics.upstreamConnected((performance.now() - started) / 1000))
    }
    const routeCancel = (packet: Buffer) => this.o.cancels.route(name, packet, peer)
    // Until Postgres has accepted the login: a stalled login is answered with an error, a stalled session closed.
    let handshake: Timer | undefined = timer(this.o.handshakeTimeoutMs, () => {
      const why = ticket?.waiting
        ? `login timed out waiting for a place among the logins under way (--max-logins ${this.o.logins.max}, --max-logins-per-ip ${this.o.logins.maxPerPeer})`
        : `login timed out: Postgres at ${name} did not answer within ${this.o.handshakeTimeoutMs} ms`
      ws ? this.sessions.get(ws)?.close('timeout', 1008, 'edgepg-proxy: startup not finished in time') : upgrade(new UpstreamError(why))
    })
    // (Once over, nothing of it is kept for the session's life.)
    const handshakeOver = () => void (handshake?.stop(), (handshake = undefined))
    /** Postgres accepted the login. */
    const loginAccepted = () => {
      handshakeOver()
      ticket?.release()
    }
    /** The client is gone: its place is free once its connection to Postgres is (a pool's backend has logged in). */
    const loginGone = () => {
      handshakeOver()
      const held = ticket
      if (held) backend || !up || up.closed ? held.release() : up.on('close', held.release)
    }
    /** No session after all: the backend goes back idle (its login just finished), or the connection is closed. */
    const drop = () => (backend ? pool.giveBack(backend, UNUSED) : up?.close())
    /** The client a connection outside the pool counts against, while it is open. */
    let outsider: string | undefined
    const leaveOutside = () => {
      if (outsider === undefined) return
      const n = outside.get(outsider)! - 1
      n ? outside.set(outsider, n) : outside.delete(outsider)
      outsider = undefined
    }
    socket.once('close', () => {
      if (this.upgrading.delete(socket)) release()
      if (!ws) drop(), leaveOutside()
      loginGone()
    })
    let expiry: (() => void) | undefined
    // A session outlives no token: at its exp, Postgres's kind of goodbye (a FATAL), then the close.
    const expireAt = (session: WebSocket, at: number) => {
      expiry = alarm(at, () => {
        const message = `edgepg-proxy: the session's token expired at ${new Date(at).toISOString()}; connect again with a fresh token`
        this.sessions.get(session)?.close('token_expired', 1008, 'edgepg-proxy: token expired', errorResponse('28000', message))
      })
    }
    const upgrade = (opened?: LoginOutcome | Error) => {
      if (ws) return
      if (socket.destroyed) return void drop()
      // The 101 response and Postgres's answer (sent as the session starts) leave in one write.
      socket.cork()
      if (backend || lent) this.cancelsInBand.add(req)
      const replicas = lent && this.replicasFor(name, asRole ?? login!, identity !== undefined)
      if (replicas) this.positioned.add(req)
      this.wss.handleUpgrade(req, socket, head, (session) => {
        ws = session
        req = head = undefined as never // (the closures made here live as long as the session: the request, its headers and head go now)
        this.upgrading.delete(socket)
        metrics.sessionOpened()
        const idle = timer(this.o.idleTimeoutMs ?? 900_000, () => {
          const running = this.sessions.get(session)
          if (running?.listens) return true // (waiting for notifications is what it is for)
          running?.close('timeout', 1001, 'edgepg-proxy: idle timeout')
        })
        session.once('close', () => {
          this.sessions.delete(session)
          leaveOutside()
          release()
          loginGone()
          idle.stop()
          expiry?.()
        })
        const first = login?.first.kind === 'startup' ? login.first : undefined
        const user = identity?.role ?? (first?.user || undefined)
        const named = user === undefined ? {} : { user, database: first?.database || user }
        const log = (entry: SessionLog) => {
          metrics.sessionClosed(entry)
          this.o.log?.({ ...entry, ...named })
        }
        const running =
          lent && opened && !(opened instanceof Error) && opened.kind === 'ready'
            ? runLentSession(session, {
                lender: lent.lender, answer: opened.answer, loginBytes: login?.bytes ?? 0, peer, upstream: name, budget: this.o.budget, log, onActivity: idle.touch,
                follow: (running) => this.o.cancels.follow(name, lent!.told, running),
                statementsPerBackend: this.o.lenders!.o.statements,
                claims: identity?.claims,
                client: identity ? `token ${subjectOf(identity.claims)}` : limitKey(peer),
                idleInTransactionMs: this.o.idleInTransactionMs,
                listenBuffer: this.o.listenBuffer,
                listenPolicy: this.o.listenPolicy,
                signals: this.o.signals,
                pid: lent!.told.pid,
                replicas: replicas || undefined,
              })
            : runSession(session, {
                upstream: up ?? newUpstream(), opened, loginBytes: login?.bytes, peer, offload, passwordsAllowed, connect, routeCancel,
                budget: this.o.budget,
                issueKey: (key) => this.o.cancels.issue(name, key),
                hideKey: () => this.o.cancels.hide(name),
                giveBack: backend && ((ending) => pool.giveBack(backend!, ending)),
                cancel: backend && (() => backend!.upstream.cancel(backend!.key)),
                log,
                onEstablished: loginAccepted,
                onActivity: idle.touch,
              })
        if (lent) loginAccepted()
        this.sessions.set(session, running) // (its close event comes later, and takes it out)
        if (identity) expireAt(session, identity.expiresAt)
      })
      socket.uncork()
    }

    const { lenders, upstreamTls, signals, announce: announceKey } = this.o
    const keyOf = (login: Login) =>
      login.first.kind === 'startup' && pool.enabled ? pool.key(name, login.tls, login.first.packet, login.password, identity !== undefined) : undefined
    if (problem || !login) return upgrade(problem)
    if (login.token === undefined || login.first.kind !== 'startup') return start(login)
    // A token: the proxy logs in as the role it names (over a link a password could cross, too).
    const { tokens } = this.o
    if (!tokens) return upgrade(refusal('28000', 'edgepg-proxy: this proxy takes no tokens (it was started without --jwks-url or --jwt-secret-file); log in with a password'))
    if (!passwordsAllowed) return upgrade(refusal('28000', 'edgepg-proxy: a token over plain ws:// from another machine is refused: use wss://'))
    tokens.login(login as Login & { first: { kind: 'startup' } }, target).then(
      (byToken) => {
        identity = byToken.identity
        asRole = byToken.login
        passwordsAllowed = true // (the role's password comes from the proxy's passfile)
        start(byToken.login)
      },
      (err: Error & { code?: string }) => upgrade(refusal(err.code ?? '28000', err.message))
    )

    function start(login: Login) {
      // Before a warm backend may answer: the rule holds whether or not the key is warm.
      if (login.first.kind === 'startup' && offload && !passwordsAllowed) return upgrade(passwordsRefused())
      // A login the proxy runs in full, with a password it can compare, may get a warm backend.
      const poolKey = offload || identity ? keyOf(login) : undefined
      const fresh = () => {
        const upstream = newUpstream()
        const io = { upstream: upstream.queue, toUpstream: (b: Buffer) => void upstream.write(b), passwordsAllowed, offload: offload || identity !== undefined, connect, routeCancel, secureUpstream: (asked?: ClientTls) => upstream.secure(asked) }
        return runLogin(io, login).then((outcome) => ({ upstream, outcome }))
      }
      // Transaction pooling: a key's logins are answered by its lender, once its first login has made one.
      const welcome = (lender: Lender) => {
        const { outcome, told } = lender.welcome(signals.issue())
        lent = { lender, told }
        upgrade(outcome)
      }
      const known = poolKey && lenders?.get(poolKey)
      if (known) return welcome(known)
      // Transaction pooling: while the pool is full (every backend lent), a new key's login gets a connection of
      // its own; one client has at most its share of those (a client varying its startup parameters makes a key of each).
      const client = identity ? `token ${subjectOf(identity.claims)}` : limitKey(peer)
      const outsideNow = outside.get(client) ?? 0
      if (poolKey && lenders && pool.full && outsideNow >= pool.perClient) {
        return upgrade(refusal('53300', `edgepg-proxy: every one of the pool's ${pool.maxBackends} backends is lent (--pool-max-backends), and this client already has ${outsideNow} connections to Postgres outside it, as many as one client may (--max-backends-per-client); try again shortly`))
      }
      // (A key's first login here: the other workers log a backend of it in, so that its next login there is answered at once.)
      const announce = () => announceKey?.({ edgepg: 'key', key: poolKey!, target, packet: login.first.packet.toString('base64'), password: login.password, tls: login.tls, client })
      const opening = poolKey && lenders ? lenders.lenderFor(poolKey, () => pool.open(poolKey, fresh), relogin(target, upstreamTls, login), announce) : pool.open(poolKey, fresh)
      opening.then((opened) => {
        if (opened instanceof Lender) return welcome(opened)
        up = opened.upstream
        backend = opened.backend
        if (ws) return drop() // (a session already open was refused: the login timed out)
        if (poolKey && lenders && !backend && opened.outcome.kind === 'ready') outside.set((outsider = client), (outside.get(client) ?? 0) + 1)
        if (!identity || opened.outcome.kind !== 'ready') return upgrade(opened.outcome)
        // Session mode: the backend is the session's from here on; its claims first.
        const answer = opened.outcome
        setClaims(opened.upstream, identity.claims).then(
          () => upgrade(answer),
          (err: ClaimsError) => {
            if (backend) pool.giveBack(backend, undefined)
            else up?.close()
            backend = up = undefined
            upgrade(refusal(err.code, err.message))
          }
        )
      }, upgrade)
    }
  }
}

/** A login by token the proxy refuses, as Postgres refuses one: its ErrorResponse. */
function refusal(code: string, message: string): LoginOutcome {
  return { kind: 'refused', answer: errorResponse(code, message), code, message, byProxy: true }
}

/** A fresh login for a pool key, as its first was made (a function of its own: it keeps nothing of the upgrade alive). */
/** A socket's 'error' listener (a function of no request's scope: the socket keeps it as long as it lives). */
function destroyed(this: Duplex) {
  this.destroy()
}

/** Gives back the places `held` (made outside any request's scope: whoever keeps it keeps nothing else). */
const releaser = (held: Wanted) => () => giveAll(held)

function relogin(target: HostPort, upstreamTls: UpstreamTls | undefined, login: Login) {
  return () => loginAs(target, upstreamTls, login)
}

/**
 * Fires `ms` after the last touch (0 ms: never), and again `ms` later if `fire` says to keep
 * watching. Touching only records the time, so it costs nothing per message; when the timer comes
 * due early it re-arms for what is left.
 */
type Timer = { touch(): void; stop(): void }
function timer(ms: number, fire: () => boolean | void): Timer {
  let handle: NodeJS.Timeout | undefined
  let last = Date.now()
  const arm = (delay: number) => {
    if (ms > 0) (handle = setTimeout(check, delay)).unref()
  }
  const check = () => {
    const left = last + ms - Date.now()
    if (left > 0) arm(left)
    else if (fire()) (last = Date.now()), arm(ms)
  }
  arm(ms)
  return {
    touch: () => void (last = Date.now()),
    stop: () => clearTimeout(handle),
  }
}

/** Longest delay setTimeout takes (2^31-1 ms, ~24.8 days); a longer one would fire at once. */
const MAX_DELAY = 2 ** 31 - 1

/** Fires at `when` (ms since the epoch), however far ahead: a wait longer than MAX_DELAY is taken in steps. Returns its stop. */
function alarm(when: number, fire: () => void): () => void {
  let handle: NodeJS.Timeout
  const arm = () => {
    const left = when - Date.now()
    handle = left > MAX_DELAY ? setTimeout(arm, MAX_DELAY) : setTimeout(fire, Math.max(0, left))
    handle.unref()
  }
  arm()
  return () => clearTimeout(handle)
}
