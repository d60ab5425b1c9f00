import type { WebSocket, RawData } from 'ws'
import { ByteQueue, messages, ProtocolError } from './bytes'
import type { LoginOutcome } from './login'
import { BackendKeyWatch, errorResponse, runStartup, UpstreamError, type BackendKey } from './startup'
import { TlsError, type Upstream } from './upstream'
import { IdleWatch, type Ending } from './idle-watch'

export type { UpstreamTls } from './upstream'

export interface SessionLog {
  peer: string
  upstream: string
  durationMs: number
  bytesIn: number
  bytesOut: number
  outcome: string
}

export interface SessionOptions {
  upstream: Upstream
  /**
   * What came of the login the upgrade carried (proxy/login.ts), or why it failed; without one the
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
  /** The startup is done (or left to Postgres): the handshake timeout no longer applies. */
  onEstablished?: () => void
  /** Bytes moved, either way: the idle timeout starts again. */
  onActivity?: () => void
  /**
   * The backend is the pool's: when the session ends it goes back instead of being closed, with
   * how the session left it (undefined: busy).
   */
  giveBack?: (ending: Ending | undefined) => void
  /** A CancelRequest sent in band, as it is to go to Postgres (see BackendPool.cancelRequest). */
  mapCancel?: (packet: Buffer) => Buffer
}

/** Bytes queued on a client's WebSocket past which we stop reading from Postgres. */
const HIGH_WATER = 1 << 20
/** Bytes a client may pipeline behind its password before we stop reading until auth is done. */
const MAX_HELD_BYTES = 1 << 20
/** Terminate: a client that ends its session cleanly sends it last. */
const TERMINATE = Buffer.from([0x58, 0, 0, 0, 4])

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
export function runSession(ws: WebSocket, o: SessionOptions) {
  const { upstream } = o
  const started = Date.now()
  let bytesIn = o.loginBytes ?? 0
  let bytesOut = 0
  let outcome = 'closed by client'
  /** Startup is over (or left to Postgres): bytes flow straight through. */
  let relaying = false
  let refused = false
  const fromClient = new ByteQueue()
  /** Watches Postgres's first messages, while they are relayed, for the backend's cancel key (the pool knows a pooled one's). */
  let keyWatch: BackendKeyWatch | undefined = o.giveBack ? undefined : new BackendKeyWatch()
  let backendKey: BackendKey | undefined
  /** The client's last message was Terminate: the backend is exiting by itself. */
  let clientTerminated = false
  /** For a pooled backend: whether the session leaves it idle (and the Terminate that must not reach it). */
  const watch = o.giveBack && new IdleWatch()

  // Ends the session from our side. The client may be paused by backpressure; read (and drop)
  // what it still sends, or its close reply would wait behind that until ws's 30 s close timeout.
  const closeClient = (code: number, reason?: string) => {
    ws.resume()
    ws.close(code, reason)
  }
  const toUpstream = (chunk: Buffer) => {
    if (!upstream.write(chunk)) ws.pause()
  }
  // Only the chunk that crosses the mark gets a callback: nothing is sent after it while paused,
  // so once it is written the queue has drained.
  const resume = () => upstream.resume()
  const toClient = (chunk: Buffer) => {
    o.onActivity?.()
    bytesOut += chunk.length
    const congested = ws.bufferedAmount + chunk.length > HIGH_WATER
    ws.send(chunk, congested ? resume : undefined)
    if (congested) upstream.pause()
  }
  const watchForKey = (chunk: Buffer) => {
    if (!keyWatch?.feed(chunk)) return
    backendKey = keyWatch.key
    keyWatch = undefined
  }
  const fromUpstream = (chunk: Buffer) => {
    if (keyWatch) watchForKey(chunk)
    if (watch) watch.fromBackend(chunk)
    toClient(chunk)
  }
  /** From here on, both ways, bytes as they come. */
  const relay = (plaintext = true) => {
    relaying = true
    o.onEstablished?.()
    // Over TLS inside the socket Postgres's bytes are not protocol messages: no key to find.
    if (!plaintext) keyWatch = undefined
    const held = fromClient.rest()
    if (held.length) toUpstream(held)
    const early = upstream.relay(fromUpstream)
    if (early.length) fromUpstream(early)
    ws.resume()
  }

  // Client → Postgres.
  ws.on('message', (data: RawData, isBinary: boolean) => {
    if (ws.readyState !== ws.OPEN || upstream.destroyed) return // closing: nothing more to relay
    if (!isBinary) {
      outcome = 'refused a text frame'
      return closeClient(1003, 'edgepg-proxy: expected binary frames')
    }
    let chunk = data as Buffer
    o.onActivity?.()
    bytesIn += chunk.length
    if (watch && relaying) {
      if (abandoned) return
      chunk = watch.fromClient(chunk)
      if (chunk.length) toUpstream(chunk)
      // The session is over: the backend goes back now, not when the WebSocket has closed, so that
      // a session right behind this one finds it.
      if ((clientTerminated = watch.terminated)) abandon()
      return
    }
    clientTerminated = chunk.length >= 5 && chunk.subarray(-5).equals(TERMINATE)
    if (relaying) return toUpstream(chunk)
    if (refused) return // Postgres said no; it is closing, and gets nothing more
    fromClient.push(chunk)
    if (fromClient.length > MAX_HELD_BYTES) ws.pause() // pipelined queries wait for upstream auth
  })
  upstream.onDrain = () => ws.resume()

  const refuse = (why: string) => {
    outcome = why
    refused = true
    fromClient.rest() // queries held for a session that will not be: dropped
  }
  /**
   * The startup failed before Postgres could answer: say why as Postgres would, and hang up. TLS the
   * client asked for failed below the protocol: that is reported in a text frame, as the error its
   * own TLS socket would have raised.
   */
  const startupFailed = (err: Error) => {
    if (err instanceof TlsError) {
      outcome = `TLS to Postgres failed: ${err.message}`
      ws.send(JSON.stringify({ message: err.message, code: err.code }))
      return closeClient(1000)
    }
    if (!(err instanceof ProtocolError || err instanceof UpstreamError)) return // the upstream (or the session) closed first
    outcome = `startup refused: ${err.message}`
    toClient(errorResponse(err instanceof ProtocolError ? err.code : '08P01', err.message))
    closeClient(1000)
  }
  const { opened } = o
  if (opened instanceof Error) startupFailed(opened)
  else if (opened) {
    // Postgres's answer to the login the upgrade carried: the session's first frame. (A pooled
    // backend's carries the session's own cancel key, and is no answer for the idle watch.)
    if (opened.answer.length) (watch ? toClient : fromUpstream)(opened.answer)
    if (opened.kind === 'refused') {
      refuse(`refused by Postgres: ${opened.code} ${opened.message}`)
      closeClient(1000)
    } else relay(opened.kind !== 'passthrough' || opened.plaintext)
  } else if (!o.offload) relay()
  else {
    runStartup({
      client: fromClient,
      upstream: upstream.queue,
      toClient,
      toUpstream,
      passwordsAllowed: o.passwordsAllowed,
      secureUpstream: () => upstream.secure(),
      mapCancel: o.mapCancel,
    }).then((result) => {
      if (result.kind === 'refused') return refuse(`refused by Postgres: ${result.code} ${result.message}`)
      relay(result.kind === 'authenticated' || result.plaintext)
    }, startupFailed)
  }

  const onUpstreamError = (err: NodeJS.ErrnoException) => {
    outcome = upstream.connected ? `upstream error: ${err.code ?? err.message}` : `upstream ${upstream.name} unreachable: ${err.code ?? err.message}`
    closeClient(1011, `edgepg-proxy: ${outcome}`.slice(0, 123))
  }
  const onUpstreamClose = () => {
    // Postgres may refuse (e.g. no such database) and hang up before the client sent its password:
    // pass its ErrorResponse on rather than a bare close.
    if (!relaying && !refused && ws.readyState === ws.OPEN) {
      const error = firstErrorResponse(upstream.queue.rest())
      if (error) {
        toClient(error)
        outcome = 'refused by Postgres before the password'
      }
    }
    if (ws.readyState === ws.OPEN) {
      // After the client's Terminate, Postgres hanging up is the client's doing.
      if (outcome === 'closed by client' && !clientTerminated) outcome = 'closed by upstream'
      closeClient(1000)
    }
  }
  // It may have failed or hung up already, while the upgrade was answered.
  upstream.error ? onUpstreamError(upstream.error) : upstream.on('error', onUpstreamError)
  upstream.closed ? onUpstreamClose() : upstream.on('close', onUpstreamClose)
  let abandoned = false
  const abandon = () => {
    if (abandoned) return
    abandoned = true
    if (!o.giveBack) return upstream.close(clientTerminated ? undefined : backendKey)
    upstream.off('error', onUpstreamError)
    upstream.off('close', onUpstreamClose)
    upstream.onDrain = undefined
    o.giveBack(watch ? watch.ending : undefined)
  }
  ws.on('close', () => {
    fromClient.fail(new Error('client closed'))
    abandon()
    o.log?.({ peer: o.peer, upstream: upstream.name, durationMs: Date.now() - started, bytesIn, bytesOut, outcome })
  })
  ws.on('error', (err) => {
    outcome = `client error: ${err.message}`
    abandon()
  })
}

/** The first complete ErrorResponse among whole backend messages, if any. */
const firstErrorResponse = (bytes: Buffer) => messages(bytes).find((m) => m[0] === 0x45)
