/**
 * The floor for transaction pooling over a WebSocket: the least a pooler does, run as a child process by the
 * bench. It logs SIZE backends in itself (pg.Client, then takes their sockets), answers each client's startup
 * at once (no login, no isolation, no limits, no metrics) and lends a backend per client message: the message
 * goes to a free backend (or waits in line for one), the backend's chunks go back to that client as they
 * come, and the backend is free again at a ReadyForQuery saying idle. It assumes what the bench sends: each
 * client message ends at a Sync or a Query, and nobody opens a transaction across messages.
 *
 *   node --import tsx bench/ws-pool-floor.ts <postgres connection string> <size>
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import type { Socket } from 'node:net'
import pg from 'pg'
import { WebSocketServer, type WebSocket } from 'ws'
import { announce } from './child'

const [url, size] = [process.argv[2], Number(process.argv[3] ?? 20)]
if (!url || !(size > 0)) {
  process.stderr.write('usage: ws-pool-floor.ts <postgres connection string> <size>\n')
  process.exit(2)
}

function message(type: string, body: Buffer) {
  const m = Buffer.alloc(5 + body.length)
  m.write(type)
  m.writeInt32BE(4 + body.length, 1)
  body.copy(m, 5)
  return m
}
const param = (k: string, v: string) => message('S', Buffer.from(`${k}\0${v}\0`))
/** What a trusting Postgres answers a startup with. */
const WELCOME = Buffer.concat([
  message('R', Buffer.alloc(4)),
  param('server_version', '18.0'), param('client_encoding', 'UTF8'), param('server_encoding', 'UTF8'), param('DateStyle', 'ISO, MDY'),
  param('integer_datetimes', 'on'), param('standard_conforming_strings', 'on'), param('TimeZone', 'UTC'),
  message('K', Buffer.alloc(8)),
  message('Z', Buffer.from('I')),
])

class Backend {
  client: WebSocket | null = null
  /** Bytes of the current message still to come, and the header bytes of the next one seen so far. */
  private left = 0
  private head = Buffer.alloc(6)
  private got = 0
  constructor(readonly socket: Socket) {
    socket.on('data', (chunk: Buffer) => this.read(chunk))
  }
  private read(chunk: Buffer) {
    const to = this.client!
    to.send(chunk)
    // Free again when the chunk's last message is ReadyForQuery, idle.
    let idle = false
    for (let i = 0; i < chunk.length; ) {
      if (this.left > 0) {
        const n = Math.min(this.left, chunk.length - i)
        this.left -= n
        i += n
        continue
      }
      this.head[this.got++] = chunk[i++]
      if (this.got < 5) continue
      const length = this.head.readInt32BE(1)
      if (this.head[0] === 0x5a && this.got === 5) continue // ReadyForQuery: read its status too
      idle = this.head[0] === 0x5a && this.head[5] === 0x49
      this.left = length + 1 - this.got
      this.got = 0
    }
    if (idle && this.left === 0) release(this)
  }
}

const free: Backend[] = []
const line: Array<[WebSocket, Buffer]> = []
function lend(ws: WebSocket, data: Buffer) {
  const b = free.pop()
  if (!b) return void line.push([ws, data])
  b.client = ws
  b.socket.write(data)
}
function release(b: Backend) {
  b.client = null
  free.push(b)
  const next = line.shift()
  if (next) lend(...next)
}

for (let i = 0; i < size; i++) {
  const c = new pg.Client(url)
  await c.connect()
  const socket = (c as any).connection.stream as Socket
  socket.removeAllListeners('data')
  free.push(new Backend(socket))
}

const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false, handleProtocols: () => false })
wss.on('connection', (ws, req) => {
  req.socket.setNoDelay(true)
  let started = false
  ws.on('message', (data: Buffer) => {
    if (!started) {
      // The startup message has no type byte; anything after it in the same message is the first statement.
      started = true
      ws.send(WELCOME)
      data = data.subarray(data.readInt32BE(0))
      if (data.length === 0) return
    }
    if (data[0] === 0x58) return void ws.close(1000) // Terminate
    lend(ws, data)
  })
})
wss.on('listening', () => announce(wss))
