import { HIGH_WATER, QueuedSocket } from './queued-socket'
import { cancelFrame, defaultEndpointHint, IN_WORKERS, LOGIN_PREFIX, MAX_LOGIN_CHARS, onThisMachine, resolveConfig, webSocketUrl, SUBPROTOCOL, SUBPROTOCOL_CANCEL, SUBPROTOCOL_POSITIONS, SUBPROTOCOL_POSITIONS_FRAMED, UPSTREAM_TLS_REQUEST, positionMessage, config, lastWriteVersion, type EdgeConfig } from './config'

const OPEN = 1
/** URLs whose server answered without a subprotocol, where `ws` needs none offered. */
const refusesSubprotocol = new Set<string>()

/** Where a login by token can go: the proxy must read the login, and only over a private link. */
export const TOKEN_NEEDS = 'authToken needs edgepg-proxy, wss:// (or this machine), no TLS inside, under 8 KB'
/** Credentials may ride in the upgrade only where nobody else reads it: over wss://, or to this machine. */
const privateLink = (url: string) => /^wss:/i.test(url) || (/^ws:\/\//i.test(url) && onThisMachine(url.slice(5)))

/** base64url without padding: the characters a subprotocol value may hold. */
const base64url = (bytes: Uint8Array) => Buffer.from(bytes).toString('base64').replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '')

/** What pg's `ssl` asks of the link to Postgres, for edgepg-proxy to make (see UPSTREAM_TLS_REQUEST). */
export interface UpstreamTls {
  sslmode: 'require' | 'verify-ca' | 'verify-full'
  sslnegotiation: 'postgres' | 'direct'
  servername?: string
}

function upstreamTlsRequest(tls: UpstreamTls): Buffer {
  const body = Buffer.from(Object.entries(tls).map(([name, value]) => (value === undefined ? '' : `${name}\0${value}\0`)).join('') + '\0')
  const head = Buffer.alloc(8)
  head.writeInt32BE(8 + body.length, 0)
  head.writeInt32BE(UPSTREAM_TLS_REQUEST, 4)
  return Buffer.concat([head, body])
}

/** A refused upgrade's HTTP response, as Node's `ws` hands it over. */
interface RefusedUpgrade {
  statusCode?: number
  setEncoding(encoding: 'utf8'): void
  on(event: 'data', listener: (chunk: string) => void): void
  on(event: 'end' | 'error', listener: () => void): void
}

/** A refused upgrade's status and text (its first KiB, one line; what came within a second, from a server that never ends it), as the error says them. */
function readReason(res: RefusedUpgrade): Promise<string> {
  return new Promise((resolve) => {
    let text = ''
    const timer = setTimeout(() => done(), 1000)
    const done = () => (clearTimeout(timer), resolve(refused(res.statusCode, text)))
    res.setEncoding('utf8')
    res.on('data', (chunk) => void (text.length < 1024 && (text += chunk)))
    res.on('end', done)
    res.on('error', done)
  })
}

function refused(status: number | undefined, text: string): string {
  const reason = text.slice(0, 1024).replace(/\s+/g, ' ').trim()
  return `was refused (HTTP ${status})${reason ? `: ${reason}` : ''}`
}

/**
 * Why a WebSocket that a browser (or a Worker) could not open was refused: the proxy answers a
 * plain GET of the URL with the status and text it refused the upgrade with, which browsers show
 * no one. Undefined when it has nothing to add (no refusal, no answer within 2 s, no proxy).
 */
const askWhy = (url: string): Promise<string | undefined> =>
  fetch(url.replace(/^ws/, 'http'), { signal: AbortSignal.timeout(2000) }).then(
    async (res) => (res.status === 426 || res.ok ? undefined : refused(res.status, await res.text())),
    () => undefined
  )

/**
 * A text frame from edgepg-proxy reports a failure below the Postgres protocol (TLS to Postgres),
 * as JSON `{ "message", "code"? }`: the error pg would have had from its own socket.
 */
function reportedError(text: string, url: string): Error {
  try {
    const { message, code } = JSON.parse(text)
    if (typeof message === 'string') return Object.assign(new Error(message), typeof code === 'string' ? { code } : {})
  } catch {}
  return new Error(`edgepg: the proxy at ${url} sent a text frame; expected binary Postgres protocol data`)
}

/**
 * A WebSocket dressed as the `net.Socket` that pg's Connection drives. Writes made in one tick
 * leave as one WebSocket message (flushed on a microtask), so a Parse/Bind/Describe/Execute/Sync
 * query is one message and one flight.
 *
 * With `deferOpen`, the first flight rides in the upgrade: 'connect' is emitted at once, pg writes
 * its StartupMessage (or TlsSocket its SSLRequest and ClientHello), and the first flush opens the
 * WebSocket offering those bytes, plus `secret` (the PasswordMessage), as a subprotocol value
 * (see proxy/login/in-upgrade.ts). edgepg-proxy runs that login before it answers, so Postgres's answer is
 * the first thing to arrive. A server that does not select edgepg's subprotocol did not take the
 * login: `fallback` then sends the bytes in band.
 */
export class WebSocketSocket extends QueuedSocket {
  /** The URL this socket opened (or tried to), for error messages. */
  url = ''
  /** Open the WebSocket on the first flush, carrying it in the upgrade (set before connect()). */
  deferOpen = false
  /** The PasswordMessage to carry in the upgrade (where the link is private); set before the first flush. */
  secret?: Uint8Array
  /** Or the `authToken` (a TOKEN_MESSAGE): only ever carried in the upgrade, to edgepg-proxy, over a private link. */
  token?: Uint8Array
  /** The proxy took the login from the upgrade (it selected edgepg's subprotocol). */
  loginTaken = false
  /** The proxy takes a cancel on this WebSocket (it selected SUBPROTOCOL_CANCEL or a positions subprotocol). */
  cancelsInBand = false
  /** The proxy takes and tells positions: in the stream (SUBPROTOCOL_POSITIONS) or in frames of their own; the config.lastWrite it was last told (its version). */
  private positions: 'stream' | 'frame' | undefined
  private told = 0
  /** Sends the first flight in band, for a server that did not take the login. */
  fallback = (first: Uint8Array) => this.send(first)
  /** TLS for edgepg-proxy to make to Postgres (pg's `ssl` without `rootCerts`): asked for in the login. */
  upstreamTls?: UpstreamTls
  /** As tls.TLSSocket's, once the proxy took a login asking for TLS: the link to Postgres is TLS. */
  encrypted?: true
  alpnProtocol?: string | false
  /** Why this connection cannot be made as configured: connect() fails with it. */
  refusal?: Error
  private ws?: WebSocket
  private opened = false
  /** Where a browser's WebSocket did not open: the proxy asked why (askWhy), and the failure waits on it. */
  private askingWhy?: Promise<unknown>
  /** Closes the WebSocket from the request that opened it (see open()). */
  private closeFromOrigin?: () => void
  private referenced = true
  private cfg?: ReturnType<typeof resolveConfig>

  constructor(private readonly own: EdgeConfig = {}) {
    super()
  }

  connect(port: number | string, host: string) {
    // As net.Socket: one destroyed before it connected (a pool's connection timeout) may connect afresh.
    if (this.closed && !this.ws) this.closed = this.ending = false
    this.writable = true
    this.url = `${host}:${port}`
    if (this.refusal) {
      queueMicrotask(() => this.fail(this.refusal!))
      return this
    }
    try {
      this.cfg = resolveConfig(this.own)
      this.url = webSocketUrl(host, Number(port), this.cfg)
      if (!this.deferOpen) this.open()
      else queueMicrotask(() => this.closed || this.emit('connect'))
    } catch (err) {
      this.failSoon(err as Error)
    }
    return this
  }

  private failSoon(err: Error) {
    queueMicrotask(() => this.fail(new Error(`edgepg: cannot open a WebSocket to ${this.url}: ${err.message}`)))
  }

  /** Opens the WebSocket; `first`: the first flight, offered as the login. */
  private open(first?: Uint8Array, offer = !refusesSubprotocol.has(this.url)) {
    const secret = this.token ? [this.token] : this.secret && privateLink(this.url) ? [this.secret] : []
    const tls = this.upstreamTls && first ? [upstreamTlsRequest(this.upstreamTls)] : []
    const login = first && base64url(Buffer.concat([...tls, first, ...secret]))
    const fits = login !== undefined && login.length <= MAX_LOGIN_CHARS
    if (this.token && first && !(privateLink(this.url) && fits && offer)) return this.failSoon(new Error(TOKEN_NEEDS))
    // In band, TLS to Postgres could not be asked for: better no connection than one without it.
    if (tls.length && offer && !fits) return this.failSoon(new Error(`the login is too large for the upgrade (${login!.length} characters, at most ${MAX_LOGIN_CHARS}), and \`ssl\` needs it there`))
    const offered = [SUBPROTOCOL_POSITIONS, SUBPROTOCOL_POSITIONS_FRAMED, SUBPROTOCOL_CANCEL, SUBPROTOCOL]
    const protocols = !offer ? undefined : fits ? [...offered, LOGIN_PREFIX + login] : offered
    let ws: WebSocket
    this.askingWhy = undefined
    try {
      ws = this.ws = this.transport = new this.cfg!.webSocketConstructor(this.url, protocols) as WebSocket
    } catch (err) {
      return this.failSoon(err as Error)
    }
    // Cloudflare Workers let only the request that opened a WebSocket touch it, but a promise's
    // continuation runs in the request that made the promise: a later request resolves this one to
    // have the WebSocket closed, so the proxy frees its backend.
    if (IN_WORKERS) new Promise<void>((resolve) => (this.closeFromOrigin = resolve)).then(() => ws.close(1000)).catch(() => {})
    // Node's `ws` (and Bun) hand over Buffers by default, without a copy; elsewhere ask for ArrayBuffers.
    if (ws.binaryType !== ('nodebuffer' as BinaryType)) ws.binaryType = 'arraybuffer'
    ws.addEventListener('open', () => {
      this.opened = this.readable = true
      if (!this.referenced) this.unref()
      this.positions = ws.protocol === SUBPROTOCOL_POSITIONS ? 'stream' : ws.protocol === SUBPROTOCOL_POSITIONS_FRAMED ? 'frame' : undefined
      this.cancelsInBand = !!this.positions || ws.protocol === SUBPROTOCOL_CANCEL
      const edgepgProxy = this.cancelsInBand || ws.protocol === SUBPROTOCOL
      this.loginTaken = edgepgProxy && fits
      if (this.loginTaken && tls.length) {
        this.encrypted = true
        this.alpnProtocol = this.upstreamTls!.sslnegotiation === 'direct' && 'postgresql' // PostgreSQL requires it there
      }
      if (first && !this.loginTaken) edgepgProxy ? this.send(first) : this.fallback(first)
      if (!this.deferOpen) this.emit('connect')
      this.flush()
    })
    const onMessage = (data: unknown, text: boolean) => {
      if (this.closed) return // as net.Socket: no data after destroy()
      if (text && this.positions && String(data).startsWith('seen ')) return void (config.lastWrite = String(data).slice(5))
      if (text) return this.fail(reportedError(String(data), this.url))
      this.push(Buffer.isBuffer(data) ? data : Buffer.from(data as ArrayBuffer))
    }
    // Node's `ws` also speaks EventEmitter, whose 'message' spares a MessageEvent per message.
    const emitter = ws as unknown as { on?: (event: 'message', listener: (data: Buffer, isBinary: boolean) => void) => void }
    if (typeof emitter.on === 'function' && ws.binaryType === ('nodebuffer' as BinaryType)) emitter.on('message', (data, isBinary) => onMessage(data, !isBinary))
    else ws.addEventListener('message', ({ data }: MessageEvent) => onMessage(data, typeof data === 'string'))
    // Node's `ws` shows a refused upgrade's response, whose text is the proxy's reason (browsers show nothing).
    const refusals = ws as unknown as { on?: (event: 'unexpected-response', listener: (req: { destroy(): void }, res: RefusedUpgrade) => void) => void }
    const showsRefusals = typeof refusals.on === 'function'
    if (refusals.on) {
      refusals.on('unexpected-response', (req, res) =>
        readReason(res).then((reason) => {
          if (ws === this.ws) this.fail(this.unopened(reason))
          req.destroy()
        })
      )
    }
    ws.addEventListener('error', (event: Event) => {
      if (ws !== this.ws) return
      const detail: string | undefined = (event as ErrorEvent).message || (event as any).error?.message
      // Node's `ws` (unlike browsers) fails when a server selects no subprotocol: any server but
      // edgepg-proxy. Open again without offering one, and remember not to offer it there.
      if (protocols && !this.opened && detail?.includes('Server sent no subprotocol')) {
        refusesSubprotocol.add(this.url)
        return this.open(first, false)
      }
      if (this.opened) return this.fail(new Error(`edgepg: WebSocket to ${this.url} failed${detail ? `: ${detail}` : ''}`))
      const failed = `could not be opened${detail ? `: ${detail}` : ''}`
      if (showsRefusals) return this.fail(this.unopened(failed))
      this.askingWhy ??= askWhy(this.url).then((why) => ws === this.ws && this.fail(this.unopened(why ?? failed)))
    })
    ws.addEventListener('close', ({ code, reason }: CloseEvent) => {
      if (ws !== this.ws || this.closed || this.askingWhy) return
      // A normal close from the other side is TCP's end: Postgres (or the proxy) hung up. Any
      // other code says what went wrong.
      if (this.ending || code === 1000) this.emit('end')
      else if (this.opened) this.fail(new Error(`edgepg: WebSocket to ${this.url} was closed (code ${code}${reason ? `: ${reason}` : ''})`))
      else this.fail(this.unopened(`closed before it opened (code ${code}${reason ? `: ${reason}` : ''})`))
      this.finish()
    })
  }

  /** Why the WebSocket did not open; at the default endpoint (no config.wsProxy), with how to name the proxy. */
  private unopened(what: string): Error {
    return new Error(`edgepg: WebSocket to ${this.url} ${what}${this.cfg?.wsProxy === undefined ? ` ${defaultEndpointHint()}` : ''}`)
  }

  protected scheduleFlush() {
    if (this.flushQueued) return
    // Before the WebSocket exists, the first flight gathers until the microtask, whatever coalesceWrites says.
    if (this.cfg?.coalesceWrites === false && this.ws) return this.flush()
    this.flushQueued = true
    queueMicrotask(() => this.flush())
  }

  /**
   * False in a Cloudflare Worker's later request: the WebSocket belongs to the request that opened
   * it, and any other throws on touching it (reading readyState is the cheapest such touch).
   */
  get usableHere(): boolean {
    try {
      return this.ws?.readyState !== -1 // (a comparison a minifier keeps; a bare read it may drop)
    } catch {
      return false
    }
  }

  private flush() {
    this.flushQueued = false
    if (this.corked || !this.pending.length || this.closed) return
    if (IN_WORKERS && !this.usableHere) return void this.destroy() // what was queued cannot go; pg sees the connection end
    if (this.ws?.readyState !== OPEN && (this.ws || !this.deferOpen)) return
    const pending = this.takePending()
    let data = pending.data
    if (!this.ws) this.open(data) // the first flight rides in the upgrade
    else {
      // What it has seen goes ahead of what must not read behind it, in the same message (see SUBPROTOCOL_POSITIONS_FRAMED).
      if (this.positions && this.told !== lastWriteVersion) {
        this.told = lastWriteVersion
        if (this.positions === 'stream') data = Buffer.concat([positionMessage(config.lastWrite!), data])
        else this.ws.send(`after ${config.lastWrite}`)
      }
      if (data.length <= HIGH_WATER) this.ws.send(data)
      // A large write (a COPY's data) goes as several messages, under any proxy's message limit.
      else for (let at = 0; at < data.length; ) this.ws.send(data.subarray(at, (at += HIGH_WATER)))
    }
    for (const cb of pending.callbacks) cb()
  }

  /**
   * As net.Socket's: an unref'd connection does not keep Node running (pg-pool's allowExitOnIdle).
   * Node's `ws` has the TCP socket; elsewhere there is nothing to hold a runtime open.
   */
  ref() {
    this.referenced = true
    ;(this.ws as any)?._socket?.ref?.()
    return this
  }

  unref() {
    this.referenced = false
    ;(this.ws as any)?._socket?.unref?.()
    return this
  }

  /** Asks the proxy to cancel the statement running once `readies` ReadyForQuery have been read (cancelsInBand). */
  sendCancel(readies: number) {
    this.ws!.send(cancelFrame(readies))
  }

  /** Sends at once, ahead of anything queued: for `fallback`. */
  send(data: Uint8Array) {
    this.ws!.send(data)
  }

  /**
   * Flush what is queued, then close the WebSocket; 'close' follows the close handshake. Still
   * opening (the login under way), it is given up at once: what was queued goes nowhere.
   */
  protected close() {
    if ((IN_WORKERS && !this.usableHere) || this.ws?.readyState !== OPEN) return void this.destroy()
    this.flush()
    this.ws.close(1000)
  }

  /** Close at once, like net.Socket#destroy: 'error' (if given) then 'close'. */
  destroy(err?: Error) {
    if (this.closed) return this
    // pg destroys with a bare reason (e.g. 'timeout expired'); say which connection it was.
    if (err) this.emit('error', new Error(`edgepg: connection to ${this.url} failed: ${err.message}`, { cause: err }))
    this.ending = true
    this.writable = false
    if (IN_WORKERS && !this.usableHere) this.closeFromOrigin!()
    else
      try {
        this.ws?.close(this.opened ? 1000 : undefined)
      } catch {}
    this.finish()
    return this
  }

  private fail(err: Error) {
    if (this.closed) return
    this.emit('error', err)
    this.destroy()
  }

  private finish() {
    if (this.closed) return
    this.closed = true
    this.writable = this.readable = false
    this.pending = []
    for (const cb of this.callbacks.splice(0)) cb()
    // Asynchronously, as net.Socket does: pg's end() destroys the socket and only then listens.
    queueMicrotask(() => this.emit('close', false))
  }
}
