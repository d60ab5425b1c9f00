/**
 * A bare WebSocket-to-TCP relay (no protocol awareness, no login, no pool), run as a child process
 * by the bench: the floor for a warm query over a WebSocket. Each binary message goes to Postgres
 * as it is; each chunk Postgres sends comes back as one message.
 *
 *   node --import tsx bench/ws-relay.ts <upstream host:port>
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import net from 'node:net'
import { WebSocketServer } from 'ws'
import { announce } from './child'

const [host, port] = (process.argv[2] ?? '').split(':')
if (!host || !port) {
  process.stderr.write('usage: ws-relay.ts <upstream host:port>\n')
  process.exit(2)
}
// It selects no subprotocol: it takes no login from the upgrade, and the client sees that.
const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false, handleProtocols: () => false })
wss.on('connection', (ws, req) => {
  req.socket.setNoDelay(true)
  const upstream = net.connect({ host, port: Number(port), noDelay: true })
  ws.on('message', (data: Buffer) => upstream.write(data))
  upstream.on('data', (chunk) => ws.send(chunk))
  upstream.on('close', () => ws.close(1000))
  upstream.on('error', () => ws.terminate())
  ws.on('close', () => upstream.destroy())
})
wss.on('listening', () => announce(wss))
