/**
 * The floor for a cold session: a bare WebSocket server (no Postgres, no protocol awareness), run
 * as a child process by the bench. It selects the subprotocol offered, sends one message the size
 * of a login answer, and answers each message with one the size of a query's result:
 *
 *   node --import tsx bench/ws-echo.ts
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import { WebSocketServer } from 'ws'
import { announce } from './child'

const LOGIN_ANSWER = Buffer.alloc(400)
const RESULT = Buffer.alloc(60)
const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false, handleProtocols: (offered) => [...offered][0] ?? false })
wss.on('connection', (ws) => {
  ws.send(LOGIN_ANSWER)
  ws.on('message', () => ws.send(RESULT))
})
wss.on('listening', () => announce(wss))
