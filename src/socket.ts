import { QueuedSocket } from './queued-socket'
import { resolveConfig, webSocketUrl, SUBPROTOCOL, type EdgeConfig, type WebSocketConstructor } from './config'

const OPEN = 1
/** URLs whose server answered without a subprotocol, where `ws` needs none offered. */
const refusesSubprotocol = new Set<string>()

/**
 * A WebSocket dressed as the `net.Socket` that pg's Connection drives. Writes made in one tick
 * leave as one WebSocket message (flushed on a microtask), so a Parse/Bind/Describe/Execute/Sync
 * query is one message and one flight.
 */
export class WebSocketSocket extends QueuedSocket {
  /** The URL this socket opened (or tried to), for error messages. */
  url = ''
  /** Set on open: the proxy selected edgepg's subprotocol, so it offloads auth. */
  authOffload = false
  private ws?: WebSocket
  private opened = false

  constructor(private readonly own: EdgeConfig = {}) {
    super()
  }

  connect(port: number | string, host: string) {
    let cfg
    try {
      cfg = resolveConfig(this.own)
      this.url = webSocketUrl(host, Number(port), cfg)
      this.coalesce = cfg.coalesceWrites
      this.open(cfg.webSocketConstructor, !refusesSubprotocol.has(this.url))
    } catch (err) {
      queueMicrotask(() => this.fail(new Error(`edgepg: cannot open a WebSocket to ${this.url || `${host}:${port}`}: ${(err as Error).message}`)))
    }
    return this
  }

  private open(WebSocketClass: WebSocketConstructor, offerSubprotocol: boolean) {
    const ws = (this.ws = offerSubprotocol ? new WebSocketClass(this.url, SUBPROTOCOL) : new WebSocketClass(this.url))
    this.writable = true
    // Node's `ws` (and Bun) hand over Buffers by default, without a copy; elsewhere ask for ArrayBuffers.
    if (ws.binaryType !== ('nodebuffer' as BinaryType)) ws.binaryType = 'arraybuffer'
    ws.addEventListener('open', () => {
      this.opened = true
      this.readable = true
      this.authOffload = ws.protocol === SUBPROTOCOL
      this.emit('connect')
      if (this.pending.length) this.flush()
    })
    ws.addEventListener('message', (event: MessageEvent) => {
      const { data } = event
      if (typeof data === 'string') return this.fail(new Error(`edgepg: the proxy at ${this.url} sent a text frame; expected binary Postgres protocol data`))
      this.emit('data', Buffer.isBuffer(data) ? data : Buffer.from(data as ArrayBuffer))
    })
    ws.addEventListener('error', (event: Event) => {
      if (ws !== this.ws) return
      const detail: string | undefined = (event as ErrorEvent).message || (event as any).error?.message
      // Node's `ws` (unlike browsers) fails when a server selects no subprotocol: any server but
      // edgepg-proxy. Open again without offering one, and remember not to offer it there.
      if (offerSubprotocol && !this.opened && detail?.includes('Server sent no subprotocol')) {
        refusesSubprotocol.add(this.url)
        return this.open(WebSocketClass, false)
      }
      const what = this.opened ? 'failed' : 'could not be opened'
      this.fail(new Error(`edgepg: WebSocket to ${this.url} ${what}${detail ? `: ${detail}` : ''}`))
    })
    ws.addEventListener('close', (event: CloseEvent) => {
      if (ws !== this.ws) return
      if (!this.ending && !this.closed) {
        const reason = event.reason ? `: ${event.reason}` : ''
        const when = this.opened ? 'was closed' : 'closed before it opened'
        this.fail(new Error(`edgepg: WebSocket to ${this.url} ${when} (code ${event.code}${reason})`))
      }
      this.finish()
    })
  }

  private coalesce = true

  protected scheduleFlush() {
    if (!this.coalesce) this.flush()
    else if (!this.flushQueued) {
      this.flushQueued = true
      queueMicrotask(() => this.flush())
    }
  }

  private flush() {
    this.flushQueued = false
    if (this.corked) return
    const ws = this.ws
    if (!ws || ws.readyState !== OPEN || !this.pending.length) return
    const { data, callbacks } = this.takePending()
    ws.send(data)
    for (const cb of callbacks) cb()
  }

  /** Flush what is queued, then close the WebSocket; 'close' follows the close handshake. */
  protected close() {
    if (!this.ws || this.ws.readyState > OPEN) this.finish()
    else if (this.ws.readyState === OPEN) {
      this.flush()
      this.ws.close(1000)
    } else this.ws.close()
  }

  /** Close at once, like net.Socket#destroy: 'error' (if given) then 'close'. */
  destroy(err?: Error) {
    if (this.closed) return this
    // pg destroys with a bare reason (e.g. 'timeout expired'); say which connection it was.
    if (err) this.emit('error', new Error(`edgepg: connection to ${this.url} failed: ${err.message}`, { cause: err }))
    this.ending = true
    this.writable = false
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
