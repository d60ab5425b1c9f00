/**
 * The floor for fan-out: a bare WebSocket server (no Postgres, no pooling), run as a child process
 * by the bench. It answers each Query message with ReadyForQuery, as a server would that did
 * nothing; a Query `NOTIFY_ALL <payload>` from anyone it sends as one NotificationResponse to every
 * session, one ws send each, as a server that broadcasts a ready frame would:
 *
 *   node --import tsx bench/ws-broadcast.ts
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import { WebSocketServer } from 'ws'
import { announce } from './child'

const READY = Buffer.from([0x5a, 0, 0, 0, 5, 0x49])
const TRIGGER = 'NOTIFY_ALL '
const CHANNEL = Buffer.from('bench_all\0')

const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false, handleProtocols: (offered) => [...offered][0] ?? false })
wss.on('connection', (ws) => {
  ws.send(READY)
  ws.on('message', (data: Buffer) => {
    const sql = data.toString('utf8', 5, data.length - 1)
    if (!sql.startsWith(TRIGGER)) return ws.send(READY)
    const payload = Buffer.from(sql.slice(TRIGGER.length) + '\0')
    const frame = Buffer.alloc(9 + CHANNEL.length + payload.length)
    frame.write('A')
    frame.writeInt32BE(frame.length - 1, 1)
    CHANNEL.copy(frame, 9)
    payload.copy(frame, 9 + CHANNEL.length)
    for (const c of wss.clients) c.send(frame)
    ws.send(READY)
  })
})
wss.on('listening', () => announce(wss))
